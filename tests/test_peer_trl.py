"""benchmarks/peer_trl.py hands TRL the examples zerostack trains on: the same tokens and the
same targets (TRL turns completion_mask into labels, the model shifts them)."""

import numpy as np

from benchmarks.peer_trl import examples, in_our_order
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
