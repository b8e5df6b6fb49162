"""Out of memory, said as such: recognising a rank that ran out of memory (an allocation refused
under a memory limit, or a SIGKILL from the kernel's OOM killer) and saying how much it held and
what the memory plan suggests instead.

The suggestion is worked out before any work (preflight/memory_fit.py calls `remember`), while memory is
plentiful: a rank that has just run out of it only formats a line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

GiB = 2**30
# What an allocation refused by the OS looks like from Python: MemoryError, torch's CPU
# allocator (RuntimeError "DefaultCPUAllocator: can't allocate memory ... Error code 12") and
# accelerators' out-of-memory errors (torch.OutOfMemoryError is a RuntimeError).
OOM_TEXT = re.compile(
    r"can't allocate memory|not enough memory|out of memory|Cannot allocate memory", re.I
)

_advice: str | None = None  # the planner's line for this run (preflight/memory_fit.py sets it)


def remember(advice: str | None) -> None:
    global _advice
    _advice = advice


def advice() -> str | None:
    return _advice


def is_oom(error: BaseException) -> bool:
    """Whether an exception is an allocation the machine refused."""
    if isinstance(error, MemoryError):
        return True
    oom_class = getattr(__import__("torch"), "OutOfMemoryError", ())
    if oom_class and isinstance(error, oom_class):
        return True
    return isinstance(error, RuntimeError) and bool(OOM_TEXT.search(str(error)[:2000]))


def what_failed(error: BaseException) -> str:
    """'an allocation of 1.00 GiB failed' (torch says the size), else the error's first line."""
    text = str(error)
    size = re.search(r"tried to allocate (\d+) bytes", text)
    if size:
        return f"an allocation of {fmt(int(size.group(1)))} failed"
    first = (text.splitlines() or [""])[0][:160]
    return f"an allocation failed ({type(error).__name__}{': ' + first if first else ''})"


def fmt(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 10 else f"{b / 2**20:.0f} MiB"


def describe(how: str, held: int | None, peak: int | None) -> str:
    """'<how> (held X, peak Y); <the plan's suggestion>': what a rank that ran out of memory
    did, how much it held and what the memory plan suggests."""
    sizes = []
    if held:
        sizes.append(f"held {fmt(held)}")
    if peak and peak != held:
        sizes.append(f"peak {fmt(peak)}")
    line = how + (f" ({', '.join(sizes)})" if sizes else "")
    return line + (f"; {_advice}" if _advice else "")


# ------------------------------------------------------------------ the kernel's OOM killer
# What the kernel logs when its OOM killer takes a process (Linux 4.x-6.x):
#   "Out of memory: Killed process 1234 (python) total-vm:..."  (or "Kill process 1234")
#   "Memory cgroup out of memory: Killed process 1234 (python) ..."
#   "oom-kill:constraint=CONSTRAINT_MEMCG,...,task=python,pid=1234,uid=0"
def kernel_log_names(pid: int, log: str, since_s: float = 0.0) -> bool:
    """Whether a kernel log's text (dmesg's, "[seconds since boot] message" lines) says the OOM
    killer killed `pid` at or after `since_s` (pids are reused: an old kill is not this one)."""
    pid_re = re.compile(rf"(?:Killed|Kill) process {pid}\b|oom-kill:.*\bpid={pid}\b")
    for line in log.splitlines():
        if not pid_re.search(line):
            continue
        when = re.match(r"\s*\[\s*(\d+(?:\.\d+)?)\]", line)
        if when is None or float(when.group(1)) >= since_s:
            return True
    return False


def uptime_s() -> float:
    """Seconds since boot, the kernel log's clock (0 where unknown: every line counts)."""
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def kernel_log() -> str:
    """The kernel's ring buffer as text, or '' where it cannot be read (unprivileged)."""
    try:
        r = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
        return r.stdout if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def oom_kill_count() -> int | None:
    """The OOM kills the kernel counted in this process's memory cgroup (v2 memory.events, v1
    memory.oom_control), or None where neither can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            candidates += [
                base / path.lstrip("/") / "memory.oom_control",
                base / "memory.oom_control",
            ]
    for f in candidates:
        try:
            for row in f.read_text().splitlines():
                key, _, value = row.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def killed_by_oom(pid: int, since_s: float = 0.0, kills_before: int | None = None) -> bool:
    """Whether the kernel's OOM killer killed `pid` (a process of this host) after `since_s`
    (uptime seconds): the kernel log names it, or (where the log is closed to us) the cgroup's
    OOM-kill count rose since `kills_before`."""
    if kernel_log_names(pid, kernel_log(), since_s):
        return True
    now = oom_kill_count()
    return kills_before is not None and now is not None and now > kills_before
