"""Reader: windows over the token stream, and a global sample order that survives any resume."""

import numpy as np
import pytest
import torch

from data import BatchLoader, DataError, TokenDataset, eval_batches
from data.manifest import FORMAT_VERSION, Manifest, write_manifest
from data.shards import ShardWriter


def make_dataset(root, n_tokens=10_007, shard_tokens=3_000, dtype="uint32", val_tokens=500):
    """A dataset whose train stream is 0, 1, 2, ... so every window is easy to check."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer").mkdir()
    splits = {}
    for name, n in (("train", n_tokens), ("val", val_tokens)):
        w = ShardWriter(root, name, dtype, shard_tokens)
        lengths = np.diff(np.r_[0:n:97, n]).astype(np.int64)  # documents of 97 tokens
        w.add(np.arange(n), lengths, lengths * 3)
        splits[name] = w.close()
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        source="synthetic",
        source_detail="",
        vocab_size=2**20,
        eos_id=0,
        bos_id=None,
        pad_id=None,
        dtype=dtype,
        tokenizer_sha256="",
        args={},
        splits=splits,
    )
    write_manifest(root, manifest)
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("r") / "d")


def test_sample_i_is_the_window_starting_at_i_times_seq_len(data_dir):
    ds = TokenDataset(data_dir, "train", 64)
    assert len(ds) == (10_007 - 1) // 64
    assert len(ds.manifest.splits["train"].shards) == 4
    for i in [0, 1, 46, 47, len(ds) - 1]:  # 47 * 64 = 3008 crosses the first shard boundary
        x = ds[i]
        assert x.dtype == np.int64 and x.shape == (65,)
        assert np.array_equal(x, np.arange(i * 64, i * 64 + 65))
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds.bytes_per_token == 3.0
    assert len(TokenDataset(data_dir, "validation", 64)) == (500 - 1) // 64


def test_split_too_short_for_one_sample(data_dir):
    with pytest.raises(DataError, match="too few for one sample"):
        TokenDataset(data_dir, "val", 600)
    with pytest.raises(DataError, match="unknown split 'test'"):
        TokenDataset(data_dir, "test", 8)


def positions(loader, steps):
    """The dataset indices a loader serves over `steps` batches (x[:, 0] // seq_len)."""
    out = []
    for _ in range(steps):
        x, y = loader.next_batch()
        assert x.dtype == torch.long and x.shape == y.shape == (loader.micro_batch, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        out += (x[:, 0] // 16).tolist()
    return out


def test_two_ranks_see_every_sample_of_an_epoch_once(data_dir):
    ds = TokenDataset(data_dir, "train", 16)
    n = len(ds)  # 625 = 5**4: no micro_batch * world below divides it
    steps = n // 6 + 1
    seen = [
        np.reshape(positions(BatchLoader(ds, 3, r, 2, seed=7), steps), (steps, 3)) for r in range(2)
    ]
    merged = np.concatenate(seen, axis=1).reshape(-1)  # global order: step by step, rank by rank
    assert sorted(merged[:n]) == list(range(n))  # the first epoch: all samples, each once
    loader = BatchLoader(ds, 3, 0, 2, seed=7)
    positions(loader, steps)
    assert loader.epoch == 1 and loader.consumed_samples == steps * 6


def test_order_is_fixed_by_the_seed(data_dir):
    ds = TokenDataset(data_dir, "train", 16)
    a = positions(BatchLoader(ds, 4, 1, 2, seed=1), 5)
    assert a == positions(BatchLoader(ds, 4, 1, 2, seed=1), 5)
    assert a != positions(BatchLoader(ds, 4, 1, 2, seed=2), 5)
    expected = np.random.default_rng([1, 0]).permutation(len(ds))
    assert a[:4] == expected[4:8].tolist()  # rank 1 takes global positions 4..7


@pytest.mark.parametrize("stop", [0, 1, 5, 104, 105, 210])  # 105 steps * 6 crosses an epoch
def test_stop_and_resume_at_any_step_gives_the_same_next_batches(data_dir, stop):
    ds = TokenDataset(data_dir, "train", 16)
    full = [positions(BatchLoader(ds, 3, r, 2, seed=5), stop + 4) for r in range(2)]
    for r in range(2):
        first = BatchLoader(ds, 3, r, 2, seed=5)
        positions(first, stop)
        state = first.state_dict()
        assert state == {"consumed_samples": stop * 6, "seed": 5}
        resumed = BatchLoader(ds, 3, r, 2, seed=99)  # the checkpoint's seed wins
        resumed.load_state_dict(state)
        assert positions(resumed, 4) == full[r][stop * 3 :]


def test_resume_on_one_rank_after_two_continues_the_same_global_order(data_dir):
    ds = TokenDataset(data_dir, "train", 16)
    two = [BatchLoader(ds, 2, r, 2, seed=3) for r in range(2)]
    for _ in range(10):
        for loader in two:
            loader.next_batch()
    state = two[0].state_dict()  # what a checkpoint of the 2-rank run stores
    assert state == two[1].state_dict() == {"consumed_samples": 40, "seed": 3}
    later = [positions(loader, 3) for loader in two]
    one = BatchLoader(ds, 2, 0, 1, seed=0)
    one.load_state_dict(state)
    # world 2, 3 steps = world 1, 6 steps, rank 0 then rank 1 at each step
    two_order = [i for s in range(3) for r in range(2) for i in later[r][s * 2 : s * 2 + 2]]
    assert positions(one, 6) == two_order
    bigger = BatchLoader(ds, 4, 0, 1, seed=3, consumed_samples=40)
    assert positions(bigger, 3) == two_order  # a larger micro batch on one rank, same order


def test_eval_batches_are_fixed_disjoint_and_equal_in_number(data_dir):
    ds = TokenDataset(data_dir, "val", 16)  # 31 samples
    per_rank = [list(eval_batches(ds, 4, r, 3)) for r in range(3)]
    assert {len(b) for b in per_rank} == {3}  # ceil(31 / 12), on every rank
    seen = []
    for step in range(3):
        ids = [(x[:, 0] // 16).tolist() for x, _ in (per_rank[r][step] for r in range(3))]
        flat = [i for part in ids for i in part]
        assert len(set(flat)) == 12 and flat == [(step * 12 + k) % 31 for k in range(12)]
        seen += flat
    assert set(seen) == set(range(31))
    assert len(list(eval_batches(ds, 4, 0, 1, max_samples=10))) == 3
    with pytest.raises(DataError, match="rank 2 is outside world size 2"):
        next(eval_batches(ds, 4, 2, 2))


def test_uint16_dataset_reads_back_int64(tmp_path):
    d = make_dataset(tmp_path / "u16", n_tokens=5000, dtype="uint16")
    ds = TokenDataset(d, "train", 100)
    assert np.array_equal(ds[10], np.arange(1000, 1101))
    assert ds.document(1).tolist() == list(range(97, 193))  # EOS (the 97th token) excluded
