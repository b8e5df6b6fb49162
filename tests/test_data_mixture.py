"""Data mixtures (`--data A:0.7,B:0.3`): proportions, a deterministic order that resumes exactly on
another world size, one tokenizer for all sources, and per-source validation in a real run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_RUN, launch, read_metrics

from data import BatchLoader, DataError, Mixture, load_data, open_split, prepare
from data.manifest import FORMAT_VERSION, Manifest, write_manifest
from data.mixture import BLOCK, parse_spec
from data.shards import ShardWriter

SEQ = 8
BASES = {"a": 0, "b": 1_000_000, "c": 2_000_000}  # a window's first token says its source


def make_source(root: Path, base: int, n_tokens: int, tokenizer: str = "same") -> Path:
    """A dataset whose train stream is base, base + 1, ...: sample i starts at base + i * SEQ."""
    root.mkdir(parents=True)
    (root / "tokenizer").mkdir()
    splits = {}
    for name, n in (("train", n_tokens), ("val", 200)):
        w = ShardWriter(root, name, "uint32", 10_000)
        lengths = np.diff(np.r_[0:n:50, n]).astype(np.int64)
        w.add(base + np.arange(n), lengths, lengths * 4)
        splits[name] = w.close()
    write_manifest(
        root,
        Manifest(
            FORMAT_VERSION, "synthetic", "", 2**22, 0, None, None, "uint32", tokenizer, {}, splits
        ),
    )
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    # Sizes that share no factor with the batch, so epochs and blocks end mid-batch.
    sizes = {"a": 2_003 * SEQ + 1, "b": 331 * SEQ + 1, "c": 97 * SEQ + 1}
    return {k: make_source(root / k, BASES[k], n) for k, n in sizes.items()}


def spec(sources, **weights) -> str:
    return ",".join(f"{sources[k]}:{w}" for k, w in weights.items())


def global_order(loader_of, world: int, micro: int, steps: int, start: int = 0) -> list[int]:
    """First tokens of every sample that `world` ranks read over `steps` steps, in global order."""
    loaders = [loader_of(r, world, micro) for r in range(world)]
    for ld in loaders:
        ld.load_state_dict({"consumed_samples": start, "seed": ld.seed})
    out = []
    for _ in range(steps):
        for ld in loaders:
            out += ld.next_batch()[0][:, 0].tolist()
    return out


def source_of(first_token: int) -> str:
    return max((b, k) for k, b in BASES.items() if b <= first_token)[1]


def test_proportions_are_the_weights_within_sampling_error(sources):
    mix = open_split(spec(sources, a=0.5, b=0.3, c=0.2), "train", SEQ)
    assert isinstance(mix, Mixture)
    loader = BatchLoader(mix, 50, 0, 1, seed=11)
    n = 3 * BLOCK + 1_000
    firsts = np.concatenate([loader.next_batch()[0][:, 0].numpy() for _ in range(n // 50)])
    for k, w in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        got = np.mean([source_of(t) == k for t in firsts])
        assert abs(got - w) < 3 * math.sqrt(w * (1 - w) / n), (k, got)
    # At the end of a block each source's count is its exact share, to one sample.
    order = mix.order(11)
    src, _ = order.sources_of(np.arange(2 * BLOCK))
    assert abs(np.sum(src == 1) - 0.3 * 2 * BLOCK) <= 1


def test_each_source_is_read_once_per_pass_and_the_order_follows_the_seed(sources):
    mix = open_split(spec(sources, a=1, b=1), "train", SEQ)
    order = mix.order(3)
    idx = order(np.arange(2 * BLOCK))
    src, own = order.sources_of(np.arange(2 * BLOCK))
    n_b = len(mix.datasets[1])  # 331 samples: read many times over in 2 blocks
    b_reads = idx[src == 1][: 2 * n_b] - len(mix.datasets[0])
    assert sorted(b_reads[:n_b]) == list(range(n_b)) == sorted(b_reads[n_b:])
    assert list(own[src == 1][:5]) == [0, 1, 2, 3, 4]
    assert np.array_equal(idx, mix.order(3)(np.arange(2 * BLOCK)))
    assert not np.array_equal(idx, mix.order(4)(np.arange(2 * BLOCK)))
    assert all(mix[int(i)][0] >= BASES["b"] for i in idx[src == 1][:20])


@pytest.mark.parametrize("stop", [0, 7, 700])  # 700 steps x 6 samples crosses a block
def test_resume_on_another_world_size_continues_the_same_global_order(sources, stop):
    mix = open_split(spec(sources, a=0.7, b=0.3), "train", SEQ)

    def loader_of(rank, world, micro):
        return BatchLoader(mix, micro, rank, world, seed=5)

    straight = global_order(loader_of, 2, 3, stop + 6)  # 2 ranks x 3 = 6 samples a step
    first = [loader_of(r, 2, 3) for r in range(2)]
    for _ in range(stop):
        for ld in first:
            ld.next_batch()
    state = first[1].state_dict()
    assert state == first[0].state_dict() == {"consumed_samples": stop * 6, "seed": 5}
    for world, micro in ((3, 2), (1, 6), (6, 1)):  # the same global batch on other world sizes
        resumed = [loader_of(r, world, micro) for r in range(world)]
        for ld in resumed:
            ld.load_state_dict(state)
        later = [t for _ in range(6) for ld in resumed for t in ld.next_batch()[0][:, 0].tolist()]
        assert later == straight[stop * 6 :], (world, micro)


def test_bad_specs_and_different_tokenizers_are_refused_in_one_line(sources, tmp_path):
    a, b = sources["a"], sources["b"]
    for bad, msg in (
        (f"{a}:0.7,{b}:x", "weight 'x' .* is not a number"),
        (f"{a}:0.7,{b}:-1", "must be positive"),
        (f"{a}:1,{a}/../a:2", "given more than once"),
        (f"{a}:1,{b}:0.0001", "below the smallest share"),
        (f"{a}:1,{tmp_path}/none:1", "no such dataset folder"),
        (f"{a}:1,,{b}:1", "part '' names no folder"),
    ):
        with pytest.raises(DataError, match=msg) as e:
            load_data(bad)
        assert "\n" not in str(e.value)
    short = make_source(tmp_path / "short", BASES["c"], 100)
    with pytest.raises(DataError, match=f"the train split of {short} has 100 tokens, too few"):
        load_data(f"{a}:1,{short}:1", seq_len=150)
    other = make_source(tmp_path / "other", 0, 1_000, tokenizer="another")
    with pytest.raises(DataError, match="different tokenizers") as e:
        load_data(f"{a}:1,{other}:1")
    assert str(other) in str(e.value)
    assert [p.name for p in parse_spec(f"{a}:3,{b}")] == ["a", "b"]
    assert [float(p.weight) for p in parse_spec(f"{a}:3,{b}")] == [0.75, 0.25]
    assert load_data(f"{a}:0.7,{b}:0.3").source.startswith("mixture: ")
    assert load_data(str(a)).source == "synthetic"  # one folder: as before


@pytest.mark.slow
def test_two_rank_run_on_a_mixture_reports_each_source(tiny_data, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):  # a second corpus, prose rather than code, on the same tokenizer
        (corpus / f"{i}.txt").write_text(f"Note {i}: the quick brown fox jumps. " * (20 + i))
    other = prepare(
        str(corpus), tmp_path / "notes", tokenizer=tiny_data / "tokenizer", val_fraction=0.1,
        progress=False,
    )  # fmt: skip
    out = tmp_path / "run"
    p = launch(
        ["--data", f"{tiny_data}:0.7,{other}:0.3", "--out", str(out), *TINY_RUN, "--steps", "3",
         "--save-every", "-1"]
    )  # fmt: skip
    ev = read_metrics(out, "eval")[-1]
    names = (Path(tiny_data).name, "notes")
    assert all(f"val_loss/{n}" in ev and f"bpb/{n}" in ev for n in names), ev
    mixed = 0.7 * ev[f"val_loss/{names[0]}"] + 0.3 * ev["val_loss/notes"]
    assert ev["val_loss"] == pytest.approx(mixed, rel=1e-9)
    assert len(read_metrics(out)) == 3
    # tiny_data's 15 validation documents: the run says its figures are small-sample ones
    assert "small-sample figures" in p.stdout + p.stderr
