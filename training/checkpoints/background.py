"""One rank's background checkpoint writer (--async-save).

`save(obj, path)` takes a staged copy of the object's tensors (one copy per storage, so views
that share a buffer still share it and the file is the one torch.save would write from the
live tensors) and returns; a thread writes the copies in order, each file flushed and fsynced
and then hashed, so the seal (layout.seal) lists sizes and sha256s without reading them again.
Training may change the live tensors as soon as `save` returns. `wait` says whether every
file is durable; an error in the thread is kept and reported there, never raised in it.

The staging copy lives in host memory until its file is written: `staged_bytes` is what the
memory plan counts for it (training/memory/plan.py, "staging"). Its buffers are kept for the
next save (a run saves the same shapes every time): a host copy then costs no page faults, and
from an accelerator it is an asynchronous copy into page-locked memory, which the step's
stream orders before any later write to the live tensors; the writer waits for it to land."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from data.files import sha256_file

_DONE = object()

# The last finished save's staging buffers, by (device type, bytes): the next save copies into
# them. Only one save's worth is kept, so the pool never holds more than the plan's "staging".
_POOL: dict[tuple[str, int], list[torch.UntypedStorage]] = {}
_POOL_LOCK = threading.Lock()


class BackgroundWriter:
    def __init__(self) -> None:
        self.staged_bytes = 0  # host bytes of the staged copies (all of this save's files)
        self.written: dict[str, tuple[int, str]] = {}  # path -> (size, sha256), once durable
        self.error: str | None = None
        self.started = time.monotonic()
        self.finished: float | None = None  # when the last file was durable
        self._queue: queue.Queue = queue.Queue()
        self._buffers: list[tuple[tuple[str, int], torch.UntypedStorage]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zerostack-ckpt-writer", daemon=True)
        self._thread.start()

    def save(self, obj, path: str | Path) -> None:
        """Stage `obj`'s tensors and queue the file; returns once the copy is taken."""
        path = Path(path)
        # by name: the archive is the one a sync save writes
        self.call(obj, lambda staged: (torch.save(staged, path), [path])[1], path.name)

    def call(self, obj, write, what: str) -> None:
        """Stage `obj`'s tensors and queue `write(staged)`, a function that writes files and
        returns the paths of this rank's (the thread fsyncs and hashes them); `what` names it
        in an error. DTensors stay DTensors over a staged local shard."""
        memo: dict = {}
        staged = _stage(obj, memo)
        self.staged_bytes += sum(s.nbytes() for s in memo.values())
        self._buffers += [((k[0].type, k[2]), s) for k, s in memo.items()]
        # copies from an accelerator are in flight on its stream: the thread waits for this
        devices = {k[0] for k in memo if k[0].type != "cpu"}
        landed = [torch.Event(device=d) for d in devices]
        for e in landed:
            e.record()
        self._queue.put((staged, write, what, landed))

    def close(self) -> None:
        """No more files for this save: the thread ends after the last one."""
        if not self._closed:
            self._closed = True
            self._queue.put(_DONE)

    def done(self) -> bool:
        return self._closed and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Close and wait up to `timeout` seconds; True when every file is written (or failed:
        see `error`)."""
        self.close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:  # Linux: a thread has its own nice value; the step's threads come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._queue.get()
            if item is _DONE:
                self.finished = time.monotonic()
                _keep_for_next_save(self._buffers)
                return
            if self.error:  # one failed file fails the save; the rest are not written
                continue
            staged, write, what, landed = item
            try:
                for e in landed:
                    e.synchronize()
                for path in write(staged):
                    path = Path(path)
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    self.written[str(path)] = (path.stat().st_size, sha256_file(path))
            except Exception as e:  # disk full, permissions: reported by the seal
                self.error = f"{what}: {type(e).__name__}: {e}"
            finally:
                del staged, item


def _buffer(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A host buffer of the storage's size: the last save's, else a new one (page-locked when
    the storage is on an accelerator, so the copy runs asynchronously at full speed)."""
    with _POOL_LOCK:
        free = _POOL.get((storage.device.type, storage.nbytes()))
        if free:
            return free.pop()
    pinned = storage.device.type != "cpu"
    return torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()


def _keep_for_next_save(buffers: list[tuple[tuple[str, int], torch.UntypedStorage]]) -> None:
    """This save's buffers replace the pool (older leftovers are freed)."""
    pool: dict = {}
    for key, buf in buffers:
        pool.setdefault(key, []).append(buf)
    with _POOL_LOCK:
        _POOL.clear()
        _POOL.update(pool)


def _stage(obj, memo: dict):
    """`obj` with every tensor replaced by a host copy; tensors that share a storage share
    the copy (keyed by the storage's address), views keep their offset and strides. A DTensor
    (FSDP2) keeps its mesh and placements over a copy of its local shard."""
    if isinstance(obj, DTensor):
        local = _stage(obj.to_local(), memo)
        return DTensor.from_local(
            local,
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key not in memo:
            memo[key] = _buffer(storage)
            memo[key].copy_(storage, non_blocking=True)  # from an accelerator: in flight
        copy = torch.empty(0, dtype=obj.dtype)
        copy.set_(memo[key], obj.storage_offset(), obj.size(), obj.stride())
        return copy
    if isinstance(obj, dict):
        out = {k: _stage(v, memo) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        try:  # an OrderedDict state dict keeps its type and its _metadata (load_state_dict reads it)
            same = type(obj)(out)
        except TypeError:
            return out
        if hasattr(obj, "_metadata"):
            same._metadata = obj._metadata
        return same
    if isinstance(obj, list):
        return [_stage(v, memo) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_stage(v, memo) for v in obj)
    return obj
