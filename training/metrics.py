"""What every run shows: MFU against a measured peak, memory, and the rank-0 logger that writes
the console, metrics.jsonl, TensorBoard and (when asked) W&B."""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from pathlib import Path

import torch


# ---------------------------------------------------------------------------- peak FLOP/s
def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_key(device: torch.device, dtype: torch.dtype, threads: int) -> str:
    if device.type == "cpu":
        return f"cpu|{cpu_name()}|{dtype}|threads={threads}|torch={torch.__version__}"
    from training.distributed import accelerator

    return f"{device.type}|{accelerator().get_device_name(device.index)}|{dtype}"


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, seconds: float = 2.0
) -> float:
    """Best matmul FLOP/s this process reaches on `device` (its current thread count on CPU).

    The best over square sizes 256 to 4096: which size is fastest depends on caches and
    threads (on a 2-core EPYC, 512-768 on one thread at ~445 GFLOP/s but only ~250 at 2048), and
    a ceiling taken at one size would flatter every MFU. Sizes stop growing once one product
    takes 50 ms, so a dtype without fast kernels (fp16 on most CPUs) is measured in seconds."""
    sync = (lambda: None) if device.type == "cpu" else torch.accelerator.synchronize
    sizes = [256, 512, 768, 1024, 1536, 2048, 3072, 4096]
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        a @ b  # warm-up: kernel selection, page faults
        sync()
        end = time.perf_counter() + seconds / len(sizes)
        while True:
            t = time.perf_counter()
            a @ b
            sync()
            took = time.perf_counter() - t
            best = max(best, 2 * size**3 / took)
            if time.perf_counter() >= end:
                break
        if took > 0.05:
            break
    return best


def peak_flops(device: torch.device, dtype: torch.dtype, cache_dir: Path | None = None) -> float:
    """Per-process peak FLOP/s, measured once per machine/dtype/thread count and cached."""
    threads = torch.get_num_threads()
    key = _device_key(device, dtype, threads) + "|probe=2"  # 2: best over sizes
    cache = (cache_dir or Path.home() / ".cache" / "zerostack") / "peak_flops.json"
    table = {}
    if cache.is_file():
        try:
            table = json.loads(cache.read_text())
        except json.JSONDecodeError:
            table = {}
    if key not in table:
        table[key] = measure_peak_flops(device, dtype)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(cache)
    return float(table[key])


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: max allocated on an accelerator, peak RSS on CPU."""
    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from training.distributed import accelerator

    return int(accelerator().max_memory_allocated(device.index))


# ---------------------------------------------------------------------------- the logger
class RunLogger:
    """Rank-0 sink for metrics. Other ranks get a logger that does nothing."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        total_steps: int,
        start_step: int,
        wandb: bool = False,
        run_name: str | None = None,
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.run_dir = run_dir
        self._bar = self._tb = self._wandb = None
        self._jsonl = None
        if not enabled:
            return
        # A resumed run adds to its history; a run from step 0 starts a new one (an earlier run
        # left in the folder would otherwise mix into every reader's numbers).
        mode = "a" if start_step > 0 else "w"
        self._jsonl = open(run_dir / "metrics.jsonl", mode, buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional at run time
            self._tb = None
        if wandb:
            import wandb as wb

            os.environ.setdefault("WANDB_DIR", str(run_dir))
            self._wandb = wb.init(
                project="zerostack", name=run_name, config=config, dir=str(run_dir)
            )
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=not _tty(),
        )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._jsonl.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        for k, v in record.items():
            if isinstance(v, (int, float)) and k not in ("step", "time") and self._tb:
                self._tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, step)
        if self._wandb:
            self._wandb.log(
                {
                    f"{record.get('kind', 'train')}/{k}": v
                    for k, v in record.items()
                    if isinstance(v, (int, float))
                },
                step=step,
            )
        self.console(_fmt(record))

    def console(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, n: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
        self._jsonl.close()
        plot_loss_curve(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()


def _fmt(r: dict) -> str:
    kind = r.get("kind", "train")
    parts = [f"{kind} step {r.get('step', 0)}"]
    for k, fmt in (
        ("loss", ".4f"),
        ("val_loss", ".4f"),
        ("ppl", ".2f"),
        ("bpb", ".4f"),
        ("lr", ".3e"),
        ("grad_norm", ".3f"),
        ("tokens_per_s", ",.0f"),
        ("mfu", ".1%"),
        ("peak_mem_gb", ".2f"),
        ("skipped", "d"),
        ("loss_scale", ".0f"),
    ):
        if k in r and r[k] is not None:
            parts.append(f"{k} {format(r[k], fmt)}")
    if r.get("note"):
        parts.append(r["note"])
    return " | ".join(parts)


def plot_loss_curve(metrics_path: Path, out_png: Path) -> None:
    """Train (and validation) loss against step, from metrics.jsonl."""
    if not metrics_path.is_file():
        return
    train, val = [], []
    for line in metrics_path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if r.get("kind") == "train" and r.get("loss") is not None:
            train.append((r["step"], r["loss"]))
        elif r.get("kind") == "eval" and "val_loss" in r:
            val.append((r["step"], r["val_loss"]))
    if not train:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
