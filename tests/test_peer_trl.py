"""benchmarks/peer_trl.py hands TRL the examples zerostack trains on: the same tokens and the
same targets (TRL turns completion_mask into labels, the model shifts them); peer_trl_dpo.py
the same pairs, on which TRL's DPO loss is ours."""

import math

import numpy as np
import pytest
import torch

from benchmarks.peer_trl import examples, in_our_order
from benchmarks.peer_trl_dpo import pairs_in_our_order
from data.examples import IGNORE_INDEX, ExampleDataset


def test_trl_rows_are_the_examples_zerostack_trains_on(chat_data):
    ds = ExampleDataset(chat_data, "train", 64)
    rows = examples(str(chat_data))
    assert len(rows) == len(ds)
    for i, r in enumerate(rows):
        ids, mask = np.array(r["input_ids"]), np.array(r["completion_mask"])
        ours = ds[i]
        assert (ours[0, : len(ids)] == ids).all()
        trained = ours[1, : len(ids)] != IGNORE_INDEX
        assert (trained == (mask == 1)).all() and not (ours[1, len(ids) :] != IGNORE_INDEX).any()
        assert mask.sum() > 0 and mask[0] == 0  # a prompt, then trained tokens


def test_trl_gets_each_step_the_batches_our_reader_gives_each_rank(chat_data):
    from data.reader import BatchLoader

    mb, world, steps, seq = 3, 2, 2, 64
    rows = in_our_order(str(chat_data), seq, steps * mb * world, seed=7)
    ds = ExampleDataset(chat_data, "train", seq)
    for rank in range(world):
        loader = BatchLoader(ds, mb, rank, world, 7)
        for step in range(steps):
            x, _ = loader.next_batch()
            k = step * world + rank  # accelerate deals sequential batch k to rank k % world
            for j, r in enumerate(rows[k * mb : (k + 1) * mb]):
                ids = r["input_ids"][:seq]  # x: an example's first seq_len tokens (y: the rest)
                assert x[j, : len(ids)].tolist() == ids


def test_trl_dpo_gets_each_step_the_pairs_our_reader_gives_each_rank(pairs):
    """benchmarks/peer_trl_dpo.py: TRL's collator input (prompt, chosen and rejected tokens) is
    each pair zerostack trains on, with the same answer tokens trained, batch for batch."""
    from data.pairs import PairDataset
    from data.reader import BatchLoader

    mb, world, steps, seq = 3, 2, 2, 64
    split = pairs_in_our_order(str(pairs["data"]), seq, steps * mb * world, seed=7)
    ds = PairDataset(pairs["data"], "train", seq)
    for rank in range(world):
        loader = BatchLoader(ds, mb, rank, world, 7)
        for step in range(steps):
            x, y = loader.next_batch()[:2]
            k = step * world + rank  # accelerate deals sequential batch k to rank k % world
            for j, p in enumerate(split[k * mb : (k + 1) * mb]):
                for side, answer in enumerate((p["chosen_ids"], p["rejected_ids"])):
                    ids = p["prompt_ids"] + answer
                    row = 2 * j + side  # a pair's chosen and rejected rows, side by side
                    assert x[row, : len(ids)].tolist() == ids
                    # y[t] is token t + 1: trained exactly where that token is the answer's
                    trained = (y[row] != IGNORE_INDEX).nonzero().flatten().tolist()
                    assert trained == list(range(len(p["prompt_ids"]) - 1, len(ids) - 1))


def hf_llama(folder, vocab_size: int, seed: int):
    """A tiny Llama of seed `seed` saved to `folder`, loaded by stock transformers in fp32."""
    from transformers import AutoModelForCausalLM

    from models import build_model, save_llama

    torch.manual_seed(seed)
    ours = build_model("tiny", vocab_size=vocab_size)
    save_llama(dict(ours.named_parameters()), ours.config, folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_dpo_loss_equals_trls_dpotrainer_on_the_same_pairs(pairs, tmp_path):
    """TRL's DPOTrainer (its collator, its loss, a reference model other than the policy so the
    loss is not log 2) on the pairs the benchmark hands it, against zerostack's objective on our
    reader's rows of the same pairs: equal within 1e-5 in fp32. Needs TRL, the bench extra."""
    pytest.importorskip("trl", reason="TRL (in the dev extra: bash setup.sh) is not installed")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from benchmarks.peer_trl_dpo import pretokenized_trainer
    from data.pairs import PairDataset
    from data.reader import _to_xy
    from training.objectives.dpo import PreferenceLoss, sequence_logps

    ds = PairDataset(pairs["data"], "train", 64)
    split = pairs_in_our_order(str(pairs["data"]), 64, 4)
    policy, ref = (hf_llama(tmp_path / f"m{s}", ds.manifest.vocab_size, s) for s in (1, 2))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], beta=0.1,
                     max_length=None, gradient_checkpointing=False)  # fmt: skip
    trainer = pretokenized_trainer()(model=policy, ref_model=ref, args=args,
                                     train_dataset=Dataset.from_list(split),
                                     processing_class=AutoTokenizer.from_pretrained(pairs["tokenizer"]))  # fmt: skip
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator(split)).item()
    x, y, _ = _to_xy(np.stack([ds[int(i)] for i in ds.order(1234)(np.arange(4))]))
    with torch.no_grad():
        reference = sequence_logps(ref(input_ids=x).logits, y)[0]
        ours = PreferenceLoss("dpo", 0.1)(policy, x, y, reference=reference).item()
    assert abs(theirs - math.log(2)) > 1e-3  # the two models differ: not the trivial step 1
    assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (ours, theirs)
