"""What each rank holds while a model is built: FSDP2 on the meta device (the trainer's way),
FSDP2 from a whole model (how every other engine builds), and ZeRO-3 under `zero.Init`.

    python -m benchmarks.construction [--model 1.3B] [--ranks 2]

Each arm is its own `torchrun` of the engine's construction alone, from the same seed: the FSDP2
arms through tests/scripts/fsdp_meta_init.py (the engine built, no step), ZeRO-3 through
tests/scripts/construct_rss.py. A rank's growth is its peak resident set (the kernel's count)
less its resident set before the build, next to the model's fp32 size. Writes
benchmarks/results/construction.json; `section` renders its table into docs/scale.md."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.host import host_class
from benchmarks.provenance import code_record, today

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "construction.json"
ARMS = {  # name -> (script, its arguments after MODEL OUT)
    "fsdp2, built on the meta device": ("tests/scripts/fsdp_meta_init.py", ["--no-compare"]),
    "fsdp2, built whole then sharded": (
        "tests/scripts/fsdp_meta_init.py",
        ["--whole", "--no-compare"],
    ),
    "zero3, built under zero.Init": ("tests/scripts/construct_rss.py", ["zero3"]),
}


def run_arm(script: str, args: list[str], model: str, ranks: int) -> dict:
    from launch.launcher_argv import launcher_command
    from training.runtime.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        program = [script, model, str(out), *args]
        cmd = launcher_command("torchrun", ranks, program, port=free_port(), python=sys.executable)
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(program)} failed:\n{done.stderr[-3000:]}")
        d = json.loads(out.read_text())
    return {
        "params": d["params"],
        "ranks": [
            {
                "before": r["before"],
                "peak": r.get("build_peak", r.get("peak")),
                "seconds": r.get("seconds"),
            }  # fmt: skip
            for r in d["ranks"]
        ],
        "seconds": d.get("seconds"),
    }


def section(results: Path) -> str:
    d = json.loads((results / "construction.json").read_text())
    fp32 = 4 * d["params"]
    lines = [
        f"{d['model']} ({d['params'] / 1e9:.2f}B parameters, {fp32 / 2**30:.2f} GiB in fp32), "
        f"{d['ranks']} ranks; {d['host'].split(';')[0]}, {d['date']}, commit "
        f"{d['code']['commit'][:7]}.",
        "",
        "| construction | growth, each rank (GiB) | growth / fp32 model | seconds |",
        "|---|---:|---:|---:|",
    ]
    for name, arm in d["arms"].items():
        grew = [(r["peak"] - r["before"]) for r in arm["ranks"]]
        secs = [r["seconds"] for r in arm["ranks"] if r["seconds"] is not None]
        secs = f"{max(secs):.1f}" if secs else ""
        lines.append(
            f"| {name} | {' / '.join(f'{g / 2**30:.2f}' for g in grew)} | "
            f"{max(grew) / fp32:.2f}x | {secs} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--model", default="1.3B")
    cli.add_argument("--ranks", type=int, default=2)
    a = cli.parse_args(argv)
    arms = {}
    for name, (script, args) in ARMS.items():
        arms[name] = run_arm(script, args, a.model, a.ranks)
        print(name, json.dumps(arms[name]["ranks"]), flush=True)
    result = {
        "model": a.model,
        "ranks": a.ranks,
        "params": next(iter(arms.values()))["params"],
        "arms": arms,
        "host": host_class(),
        "date": today(),
        "code": code_record(),
    }
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(section(RESULT.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
