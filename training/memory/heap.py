"""Building a partitioned model without the heap keeping what construction freed.

Under ZeRO-3 each module is made whole (fp32), initialised, cast and cut into this rank's
partition, then the whole tensor is freed: one module at a time, so a rank should never hold
much more than its partition. But the trainer keeps freed blocks of up to 32 MiB on glibc's heap
for the training steps (runtime/distributed.py, keep_freed_memory), and the partitions, kept,
sit between the freed whole tensors: the heap can neither reuse nor return those holes, and a
rank's resident set grew to several times its partition. With every block of 1 MiB or more in a
mapping of its own while the model is built (returned to the OS the moment it is freed) it stays
near it (measured and bounded in tests/test_scale_memory.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # <malloc.h>
KEPT_BLOCK = 32 * 2**20  # what keep_freed_memory sets for training
GLIBC_DEFAULT = 128 * 2**10


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return None


@contextlib.contextmanager
def freed_blocks_returned(threshold: int = 2**20, kept: bool = True):
    """Inside: every allocation of `threshold` bytes or more is its own mapping, unmapped when
    freed; after: the training steps' setting again (`kept`: the trainer's --keep-freed-memory,
    else glibc's default), and the heap's free top given back. A no-op off glibc."""
    libc = _libc()
    if libc is None or libc.mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK if kept else GLIBC_DEFAULT)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
