"""Chat and instruction data: the three JSONL shapes rendered with the tokenizer's chat template,
the per-token loss mask exact at the template's boundaries (an HF-shaped tokenizer with special
tokens, and our own SentencePiece tokenizer with a template file), truncation and dropping
counted in the manifest, bad rows refused in one line with nothing written, and the reader's
padded examples resuming exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, chat_rows, chat_tokenizer

from data import BatchLoader, DataError, ExampleDataset, load_manifest, prepare
from data.chat import to_messages
from data.examples import IGNORE_INDEX


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def trained_text(tok, sample) -> str:
    return tok.decode(sample[1][sample[1] != IGNORE_INDEX])


@pytest.fixture(scope="module")
def hf_tok(tiny_data, tmp_path_factory):
    return chat_tokenizer(tiny_data, tmp_path_factory.mktemp("tok") / "chatml")


def test_shapes_render_as_apply_chat_template_and_train_on_the_answers(hf_tok, tmp_path):
    from transformers import AutoTokenizer

    rows = chat_rows(6)
    multi = {"messages": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "one"},
                          {"role": "user", "content": "b?"}, {"role": "assistant", "content": "two"}]}  # fmt: skip
    src = write_jsonl(tmp_path / "c.jsonl", [*rows, multi])
    out = prepare(
        src, tmp_path / "d", tokenizer=hf_tok, seq_len=512, val_fraction=0, progress=False
    )
    ds = ExampleDataset(out, "train", 512)
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert len(ds) == 7
    for i, row in enumerate([*rows, multi]):
        messages = to_messages(row, "row")
        want = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        sample = ds[i]
        n = len(want)
        assert sample[0, :n].tolist() == want  # the tokens inference will see
        assert (sample[1, n:] == IGNORE_INDEX).all()  # padding never trains
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert trained_text(tok, sample) == "".join(f"{a}<|im_end|>\n" for a in answers)
    m = load_manifest(out)
    assert m.chat["examples"] == 7 and m.chat["truncated"] == 0
    assert m.chat["trained_tokens"]["train"] == int(
        (np.stack([ds[i] for i in range(7)])[:, 1] >= 0).sum()
    )

    last = prepare(src, tmp_path / "c", tokenizer=hf_tok, train_on="completion", val_fraction=0,
                   progress=False)  # fmt: skip
    assert trained_text(tok, ExampleDataset(last, "train", 512)[6]) == "two<|im_end|>\n"
    every = prepare(src, tmp_path / "a", tokenizer=hf_tok, train_on="all", val_fraction=0,
                    progress=False)  # fmt: skip
    sample = ExampleDataset(every, "train", 512)[6]
    assert (sample[1, 1 : len(tok.apply_chat_template(multi["messages"])["input_ids"])] >= 0).all()


def test_our_tokenizer_with_a_template_file(tiny_data, tmp_path):
    """Our SentencePiece tokenizer has no template: --chat-template gives one, and the mask
    starts and ends exactly at the completion."""
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant:\n{% endif %}"
    )
    rows = [{"prompt": 'def add(a, b):\n    """Sum."""\n', "completion": "    return a + b"},
            {"prompt": "x", "completion": "import os\nos.getcwd()"}]  # fmt: skip
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(DataError, match="has no chat template; give one with --chat-template"):
        prepare(src, tmp_path / "none", tokenizer=tiny_data / "tokenizer", progress=False)
    assert not (tmp_path / "none").exists()
    out = prepare(src, tmp_path / "d", tokenizer=tiny_data / "tokenizer", chat_template=template,
                  val_fraction=0, progress=False)  # fmt: skip
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert tok.chat_template == template.read_text()  # inference renders as training did
    ds = ExampleDataset(out, "train", 64)
    for i, row in enumerate(rows):
        assert trained_text(tok, ds[i]) == row["completion"] + "\n"


def test_too_long_examples_truncated_or_dropped_and_counted(hf_tok, tmp_path):
    rows = [{"prompt": "p", "completion": "word " * 80}, {"prompt": "q " * 80, "completion": "a"},
            {"prompt": "r", "completion": "short"}]  # fmt: skip
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    cut = prepare(src, tmp_path / "t", tokenizer=hf_tok, seq_len=32, val_fraction=0, progress=False)
    chat = load_manifest(cut).chat
    # the second is cut inside its prompt: nothing left to train on
    assert (chat["examples"], chat["truncated"], chat["dropped_untrained"]) == (2, 2, 1)
    assert chat["longest"] == 33
    ds = ExampleDataset(cut, "train", 32)
    assert len(ds) == 2 and (ds[0][1] >= 0).sum() == 33 - 14  # all but the prompt
    with pytest.raises(DataError, match="--seq-len 16: .* up to 33 tokens"):
        ExampleDataset(cut, "train", 16)
    drop = prepare(src, tmp_path / "x", tokenizer=hf_tok, seq_len=32, too_long="drop",
                   val_fraction=0, progress=False)  # fmt: skip
    chat = load_manifest(drop).chat
    assert (chat["examples"], chat["dropped_too_long"], chat["truncated"]) == (1, 2, 0)


@pytest.mark.parametrize(
    "bad, says",
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "c.jsonl:2: not valid JSON"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            "c.jsonl:2: message 0 has role 'robot'",
        ),
        ({"prompt": "hi"}, "c.jsonl:2: field 'completion' missing or not text"),
        ({"text": "hi"}, "c.jsonl:2: not a chat example"),
    ],
)
def test_bad_row_refused_in_one_line_nothing_written(hf_tok, tmp_path, capsys, bad, says):
    from data.prepare import main

    src = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "completion": "b"}, bad])
    out = tmp_path / "out"
    code = main(["--source", src, "--chat", "--tokenizer", str(hf_tok), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: ") and says in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_chat_without_tokenizer_refused(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match="is chat data: give the model's tokenizer"):
        prepare(src, tmp_path / "out", progress=False)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match="--chat-template is for chat data, and .* is a text"):
        prepare(text, tmp_path / "out", chat_template=tmp_path / "x.jinja", progress=False)
    assert not (tmp_path / "out").exists()


def test_examples_resume_exactly_on_another_world(chat_data):
    ds = ExampleDataset(chat_data, "train", 64)
    sample = ds[0]
    assert sample.shape == (2, 65)
    ref = BatchLoader(ds, 2, 0, 1, seed=3)
    want = [ref.next_batch() for _ in range(6)]
    x, y = want[0]
    assert x.shape == y.shape == (2, 64) and (y == IGNORE_INDEX).any() and (y >= 0).any()
    # 2 ranks of 1 from the state after 2 batches of 2: the rest, in the same order
    state = {"consumed_samples": 4, "seed": 3}
    ranks = [BatchLoader(ds, 1, r, 2, seed=0) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for xb, yb in want[2:]:
        got = [r.next_batch() for r in ranks]
        assert all((g[0][0] == xb[k]).all() and (g[1][0] == yb[k]).all() for k, g in enumerate(got))


def test_instruction_set_from_python_split_by_file(tiny_data, tmp_path):
    """data.instructions: signature and docstring -> body, whole files to one split; then
    prepare with --val-source and the plain template for our own tokenizer."""
    from transformers import AutoTokenizer

    from data.instructions import build

    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        (src / f"m{k}.py").write_text(
            f'def f{k}(x):\n    """Double {k}."""\n    return 2 * x\n\n\n'
            f'class C{k}:\n    def g(self):\n        """Say {k}."""\n        y = {k}\n        return y\n\n'
            f'def undocumented(x):\n    return x\n'
        )  # fmt: skip
    counts = build(src, tmp_path / "set", val_fraction=0.34, seed=0)
    rows = {n: [json.loads(line) for line in (tmp_path / "set" / f"{n}.jsonl").open()]
            for n in ("train", "val")}  # fmt: skip
    assert counts == {"train": 4, "val": 2} == {n: len(r) for n, r in rows.items()}
    (v0, v1) = rows["val"]
    k = v0["prompt"][5]  # every function of the validation file, and of no other file
    assert v0 == {
        "prompt": f'def f{k}(x):\n    """Double {k}."""\n',
        "completion": "    return 2 * x\n",
    }
    assert v1 == {"prompt": f'def g(self):\n    """Say {k}."""\n', "completion": f"    y = {k}\n    return y\n"}  # fmt: skip
    assert all(k not in r["prompt"] for r in rows["train"])

    plain = REPO / "data" / "templates" / "plain.jinja"
    out = prepare(tmp_path / "set" / "train.jsonl", tmp_path / "d", tokenizer=tiny_data / "tokenizer",
                  chat_template=plain, val_source=tmp_path / "set" / "val.jsonl", progress=False)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    val = ExampleDataset(out, "val", 64)
    assert len(val) == 2 and len(ExampleDataset(out, "train", 64)) == 4
    for i, row in enumerate(rows["val"]):
        n = int((val[i][0] != val.pad).sum())
        assert tok.decode(val[i][0][:n]) == row["prompt"] + row["completion"] + "</s>"
        assert trained_text(tok, val[i]) == row["completion"] + "</s>"
