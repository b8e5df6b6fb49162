"""--async-save: checkpoints written in the background, sealed only once every rank's files are
durable. Real 2-rank runs: an interrupted run with background saves resumes bit for bit where
an uninterrupted run with synchronous saves ends (ZeRO-2, DDP; ZeRO-3 and FSDP2 in fp32), a rank
killed while a background save is in flight leaves that checkpoint unsealed: never resumed from,
set aside on the next start, and so does a write that fails (a file-size limit, as a full disk)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import launch, rank_exit_codes, read_metrics
from test_reliability import Job, args, launch_with_file_limit

from training.checkpoints import layout
from training.checkpoints.background import BackgroundWriter

STEPS = 12


def _losses(run: Path) -> list[float]:
    final = {r["step"]: r["loss"] for r in read_metrics(run)}  # the last record of a step wins
    return [final[s] for s in sorted(final)]


# ------------------------------------------------------------------------------ one process
def test_the_background_writer_writes_what_the_tensors_held_when_it_was_called(tmp_path):
    """The staged copy, not the live tensors: training may change them at once. Views that
    share a buffer still share it (the same file a synchronous torch.save writes), and the
    writer's size and sha256 are the file's."""
    flat = torch.arange(10.0)
    sd = OrderedDict(a=flat[:4], b=flat[4:], groups=[{"lr": 0.1, "t": torch.ones(3)}])
    sd._metadata = {"": {"version": 1}}
    (tmp_path / "sync").mkdir()
    (tmp_path / "bg").mkdir()
    torch.save(sd, tmp_path / "sync" / "x.pt")
    writer = BackgroundWriter()
    writer.save(sd, tmp_path / "bg" / "x.pt")
    flat.add_(100)  # the step goes on
    sd["groups"][0]["t"].zero_()
    sd["groups"][0]["lr"] = 0.2
    assert writer.wait(60) and writer.error is None
    want, got = (tmp_path / "sync" / "x.pt").read_bytes(), (tmp_path / "bg" / "x.pt").read_bytes()
    assert got == want
    size, digest = writer.written[str(tmp_path / "bg" / "x.pt")]
    assert size == len(got)
    assert writer.staged_bytes == 10 * 4 + 3 * 4


def test_the_next_save_copies_into_the_last_saves_buffers_and_writes_its_own_values(tmp_path):
    """The staging buffers are kept between saves (no page faults, page-locked from an
    accelerator): the second save reuses them and still writes what the tensors held then."""
    flat = torch.arange(10.0)
    sd = {"a": flat[:4], "b": flat[4:], "c": torch.ones(3)}
    first = BackgroundWriter()
    first.save(sd, tmp_path / "1.pt")
    assert first.wait(60) and first.error is None
    kept = {b.data_ptr() for _, b in first._buffers}
    flat.add_(100)
    second = BackgroundWriter()
    second.save(sd, tmp_path / "2.pt")
    flat.add_(100)  # after the copy: not in the second file
    assert second.wait(60) and second.error is None
    assert {b.data_ptr() for _, b in second._buffers} == kept
    got = torch.load(tmp_path / "2.pt")
    assert torch.equal(got["a"], torch.arange(4.0) + 100)
    assert torch.equal(got["b"], torch.arange(4.0, 10.0) + 100)
    assert torch.equal(torch.load(tmp_path / "1.pt")["a"], torch.arange(4.0))


def test_a_failed_background_write_is_reported_not_raised(tmp_path):
    writer = BackgroundWriter()
    writer.save({"w": torch.ones(2)}, tmp_path / "no such folder" / "x.pt")
    assert writer.wait(60)
    assert writer.error and "x.pt" in writer.error
    assert not writer.written


def test_unsealed_checkpoints_are_set_aside_not_deleted(tmp_path):
    root = tmp_path / "checkpoints"
    for tag, sealed in (("step_00000002", True), ("step_00000004", False)):
        (root / tag).mkdir(parents=True)
        (root / tag / "f").write_text(tag)
        if sealed:
            layout.write_listing(root / tag)
    said = []
    moved = layout.set_aside_unsealed(root, said.append)
    assert moved == [root / "unsealed" / "step_00000004"]
    assert (root / "unsealed" / "step_00000004" / "f").read_text() == "step_00000004"
    assert (root / "step_00000002" / "complete.json").is_file()
    assert "moved the unsealed checkpoint" in said[0]
    assert layout.all_tags(root) == ["step_00000002"]


class _OneFileEngine:
    """Writes one file the way every engine's synchronous save does: a torch.save, no fsync."""

    def save(self, root, tag, client_state, writer=None):
        (root / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.ones(4)}, root / tag / "model.pt")


def test_a_synchronous_save_fsyncs_the_engine_files_before_it_seals(tmp_path, monkeypatch):
    """Durable before sealed: the engine's file is fsynced before complete.json is written (a
    power loss after the seal must not lose the file from the page cache)."""
    order = []
    fsync = os.fsync

    def watched(fd):
        order.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    layout.save(_OneFileEngine(), tmp_path, 2, {"step": 2}, keep_last=0, is_main=True)
    assert "model.pt" in order and "trainer_state.json" in order
    complete = [i for i, n in enumerate(order) if n.startswith(".complete.json")]
    assert complete and order.index("model.pt") < complete[0], order


# ------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    """Synchronous saves, uninterrupted: what every run here must match."""
    out = tmp_path_factory.mktemp("async") / "reference"
    launch(args(tiny_data, out, save_every=2))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed", "ddp"])
def test_background_saves_resume_exactly_like_synchronous_ones(
    tiny_data, reference, tmp_path, backend
):
    """ZeRO-2 (the default config) and DDP: stopped at step 6 and resumed, with --async-save,
    the run's every loss and its last checkpoint's weights equal an uninterrupted synchronous
    run's (the DDP reference is its own synchronous run)."""
    extra = ["--backend", backend] if backend != "deepspeed" else []
    if backend != "deepspeed":
        ref = tmp_path / "reference"
        launch(args(tiny_data, ref, *extra, save_every=2))
    else:
        ref = reference
    out = tmp_path / "async"
    first = launch(args(tiny_data, out, *extra, "--async-save", "--stop-at", "6", save_every=2))
    text = first.stdout + first.stderr
    assert "saving checkpoint step_00000002 in the background" in text, text[-3000:]
    assert "saved checkpoint step_00000006 (written in the background" in text, text[-3000:]
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step_00000006"
    records = read_metrics(out, "checkpoint")
    assert [r["step"] for r in records] == [2, 4, 6] and all(r["async"] for r in records)
    for tag in layout.all_tags(root):
        layout.verify(root / tag)  # sealed with the writers' hashes: they are the files'
    second = launch(args(tiny_data, out, *extra, "--async-save", save_every=2))
    assert "resumed from step_00000006" in second.stdout + second.stderr
    assert _losses(out) == _losses(ref)
    assert len(_losses(out)) == STEPS
    tag = layout.tag_for(STEPS)
    mine, theirs = (
        sorted((root / tag).rglob("*.pt")),
        sorted((ref / "checkpoints" / tag).rglob("*.pt")),
    )
    assert [p.name for p in mine] == [p.name for p in theirs] and mine
    for a, b in zip(
        mine, theirs, strict=True
    ):  # weights, optimizer partitions, everything a resume loads
        ta, tb = (
            _tensors(torch.load(a, weights_only=False)),
            _tensors(torch.load(b, weights_only=False)),
        )
        assert len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True)), (
            a.name
        )


SHARDED = {
    "fsdp": ["--backend", "fsdp", "--precision", "fp32"],
    "zero3": ["--ds-config", "ds_configs/zero3.json", "--precision", "fp32"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SHARDED))
def test_sharded_background_saves_resume_exactly_like_synchronous_ones(tiny_data, tmp_path, case):
    """FSDP2 (DCP's files, written by the writer's thread on a group of its own) and ZeRO-3 in
    fp32: stopped at step 4 with --async-save and resumed, every loss and the last checkpoint's
    every shard file equal an uninterrupted run's with synchronous saves, bit for bit."""
    extra, steps = SHARDED[case], 8
    ref, out = tmp_path / "reference", tmp_path / "async"
    launch(args(tiny_data, ref, *extra, steps=steps, save_every=2))
    first = launch(
        args(tiny_data, out, *extra, "--async-save", "--stop-at", "4", steps=steps, save_every=2)
    )
    text = first.stdout + first.stderr
    assert "saved checkpoint step_00000004 (written in the background" in text, text[-3000:]
    root = out / "checkpoints"
    assert [r["step"] for r in read_metrics(out, "checkpoint") if r["async"]] == [2, 4]
    for tag in layout.all_tags(root):
        layout.verify(root / tag)  # sealed with the writers' hashes: they are the files'
    second = launch(args(tiny_data, out, *extra, "--async-save", steps=steps, save_every=2))
    assert "resumed from step_00000004" in second.stdout + second.stderr
    assert _losses(out) == _losses(ref) and len(_losses(out)) == steps
    tag = layout.tag_for(steps)
    names = ("*.distcp", "*.pt") if case == "fsdp" else ("*.pt",)
    mine = sorted(p for n in names for p in (root / tag).rglob(n))
    theirs = sorted(p for n in names for p in (ref / "checkpoints" / tag).rglob(n))
    assert [p.name for p in mine] == [p.name for p in theirs] and mine
    for a, b in zip(
        mine, theirs, strict=True
    ):  # weights, optimizer shards, everything a resume loads
        if a.suffix == ".distcp":  # DCP's shard files: the same bytes
            assert a.read_bytes() == b.read_bytes(), a.name
            continue
        ta, tb = (
            _tensors(torch.load(a, weights_only=False)),
            _tensors(torch.load(b, weights_only=False)),
        )
        assert len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True)), (
            a.name
        )


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in obj for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


@pytest.mark.slow
def test_kill_9_during_a_background_save_never_seals_it(tiny_data, reference, tmp_path):
    """A save is in flight from the moment rank 0 says "saving ... in the background" until it
    says "saved": rank 1 is frozen (SIGSTOP) right after the first, and killed (SIGKILL) when
    its checkpoint is still unsealed (else the next save is tried). The checkpoint stays
    unsealed, `latest` names the previous one, the next start moves it aside (not deleted) and
    resumes from the previous one, exactly."""
    out = tmp_path / "killed"
    run = args(tiny_data, out, "--async-save", "--dist-timeout", "120", save_every=2)
    job = Job.torchrun(run)
    root = out / "checkpoints"
    caught, seen = None, 1  # from the second save on: there is a sealed one to fall back to
    try:
        pid = job.rank_pid(1)
        while caught is None:
            m = None
            end = time.time() + 300
            while m is None and time.time() < end:  # a tight watch: a tiny step is ~20 ms
                found = re.findall(r"saving checkpoint (step_\d+) in the background", job.output)
                m = found[seen] if len(found) > seen else None
                time.sleep(0.001)
            assert m is not None, job.output[-3000:]
            seen += 1
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.5)  # a seal rank 1 already took part in lands now, if at all
            if not (root / m / "complete.json").exists():
                caught = m
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGCONT)
            assert caught or seen < STEPS // 2, (
                "every save was sealed before rank 1 could be frozen"
            )
        job.finish(timeout=200)
    finally:
        job.kill()
    step = int(caught.removeprefix("step_"))
    previous = layout.tag_for(step - 2)
    assert not (root / caught / "complete.json").exists()
    assert (root / "latest").read_text() == previous
    assert layout.find_latest(root) == previous

    # the rest of the reference's run, from the previous checkpoint
    r = launch(args(tiny_data, out, "--async-save", save_every=2))
    text = r.stdout + r.stderr
    assert f"moved the unsealed checkpoint {root / caught}" in text, text[-3000:]
    assert (root / "unsealed" / caught).is_dir()
    assert f"resumed from {previous}" in text, text[-3000:]
    got = {x["step"]: x["loss"] for x in read_metrics(out)}
    want = {x["step"]: x["loss"] for x in read_metrics(reference)}
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]
    assert json.loads((root / "step_00000012" / "complete.json").read_text())["files"]


@pytest.mark.slow
def test_sigterm_with_a_background_save_in_flight_finishes_it_then_saves_and_resumes_exactly(
    tiny_data, reference, tmp_path
):
    """SIGTERM to rank 1 the moment a background save starts: the save in flight is finished
    and sealed within the grace, the stop step is saved and sealed too, `latest` names it, and
    the re-run ends where an uninterrupted synchronous run ends."""
    out = tmp_path / "preempted"
    run = args(tiny_data, out, "--async-save", save_every=2)
    job = Job.torchrun(run)
    try:
        job.wait_for(r"saving checkpoint step_00000004 in the background")
        os.kill(job.rank_pid(1), signal.SIGTERM)
        m = job.wait_for(r"stopped by SIGTERM \(received by rank 1\) after step (\d+)[^\n]*")
        job.finish()
    finally:
        job.kill()
    stopped = int(m.group(1))
    assert stopped < STEPS
    assert f"resume from {layout.tag_for(stopped)}" in m.group(0)
    root = out / "checkpoints"
    assert (root / "latest").read_text() == layout.tag_for(stopped)
    assert layout.is_complete(root / "step_00000004")  # the one in flight at the signal
    assert layout.is_complete(root / layout.tag_for(stopped))
    r = launch(run)
    assert f"resumed from {layout.tag_for(stopped)}" in r.stdout + r.stderr
    got = {x["step"]: x["loss"] for x in read_metrics(out)}
    want = [x["loss"] for x in read_metrics(reference)]
    assert [got[s] for s in range(1, STEPS + 1)] == want


@pytest.mark.slow
def test_disk_full_during_a_background_write_seals_nothing_and_resumes_from_the_last(
    tiny_data, reference, tmp_path
):
    """A file-size limit (RLIMIT_FSIZE, inherited by the ranks) fails the background writers'
    files the way a full disk does: the run stops saying which checkpoint is intact, nothing
    is sealed, and a re-run sets the unsealed folder aside and resumes from the last sealed."""
    import resource

    out = tmp_path / "full"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("tensorboard"))
    limit = 200_000  # smaller than the engine's files, larger than logs and metrics

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = args(tiny_data, out, "--async-save", steps=16, save_every=2)
    text = launch_with_file_limit(run, small_files)
    assert "saving checkpoint step_00000014 in the background" in text, text[-4000:]
    assert set(rank_exit_codes(text)) == {5}, text[-4000:]
    line = re.search(r"error: (rank 1 stopped: )?could not write checkpoint step_00000014.*", text)
    assert line and "the previous checkpoint step_00000012 is intact" in line.group(0), text[-4000:]
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step_00000012"
    assert not (root / "step_00000014" / "complete.json").exists()

    r = launch(run)
    text = r.stdout + r.stderr
    assert f"moved the unsealed checkpoint {root / 'step_00000014'}" in text, text[-3000:]
    assert "resumed from step_00000012" in text, text[-3000:]
    assert (root / "latest").read_text() == "step_00000016"
