"""Where the ranks run and what each launcher hands over.

Every launcher we support (the deepspeed launcher, locally or over ssh with --hostfile; torchrun;
accelerate launch; SLURM through either) sets RANK, WORLD_SIZE and LOCAL_RANK, and
training/runtime/distributed.py builds the process group from them. This module records the result per
rank (host, address, first batch) so a run folder shows where and on what each rank trained, and
handles accelerate launch's extras: its DeepSpeed config file, and its own process state, which on
a CPU silently believes in a world of one unless it is told the backend.
"""

from __future__ import annotations

import hashlib
import os
import socket

import torch.distributed as dist

from training.errors import ConfigError, LaunchError

ACCELERATE_DS_CONFIG = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def launched_by_accelerate() -> bool:
    return any(k.startswith("ACCELERATE_") for k in os.environ) and "LOCAL_RANK" in os.environ


def accelerate_ds_config(flag_value: str | None) -> str | None:
    """The DeepSpeed config to use under `accelerate launch`: accelerate's `deepspeed_config_file`
    when --ds_config was not given. Both given and different is an error (one line)."""
    theirs = os.environ.get(ACCELERATE_DS_CONFIG) if launched_by_accelerate() else None
    if not theirs:
        return flag_value
    if flag_value and os.path.realpath(flag_value) != os.path.realpath(theirs):
        raise ConfigError(
            f"the accelerate config names deepspeed_config_file {theirs} but --ds_config is "
            f"{flag_value}: give one of them"
        )
    return theirs


def align_accelerate_state(backend: str) -> dict | None:
    """Under `accelerate launch`, make accelerate's process state agree with our process group.

    Anything that asks accelerate (its data loaders, `Accelerator`, libraries built on it) must
    see the same world as we do. On a CPU, accelerate finds no device backend and, unless told
    `backend="gloo"`, reports one process: every rank would then read all the data. We pass our
    backend; if accelerate still disagrees with torch.distributed, we stop. Returns what
    accelerate reports, or None when not launched by accelerate."""
    if not launched_by_accelerate():
        return None
    from accelerate.state import PartialState  # accelerate is optional: only under its launcher

    state = PartialState(backend=backend)
    seen = {
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "backend": state.backend,
    }
    want = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if (state.num_processes, state.process_index) != want:
        raise LaunchError(
            f"accelerate sees {state.num_processes} process(es) (this is #{state.process_index}) "
            f"but torch.distributed has world {want[0]} (rank {want[1]}): accelerate would give "
            "every rank all the data; launch with a backend accelerate knows for this device"
        )
    return seen


def local_address() -> str | None:
    """The address this host uses to reach the master (no packet is sent)."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
    except OSError:
        return None


def describe_ranks(
    rank: int, local_rank: int, first_batch, coordinates: dict, built: dict | None = None
) -> list[dict]:
    """All ranks call; every rank gets the list, by rank: host name, address towards the master,
    local rank, pid, and the first training batch it will read (a hash of its tokens and their
    sum), `coordinates` (which data-parallel replica, tensor/sequence-parallel rank or pipeline
    stage it is) and `built` (what building its model took). Ranks that share a batch hash are
    reading the same data."""
    x = first_batch.contiguous()
    mine = {
        "rank": rank,
        "local_rank": local_rank,
        "host": socket.gethostname(),
        "addr": local_address(),
        "pid": os.getpid(),
        **coordinates,
        "built": built,
        "first_batch_sha1": hashlib.sha1(x.numpy().tobytes()).hexdigest()[:16],
        "first_batch_token_sum": int(x.sum()),
    }
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
