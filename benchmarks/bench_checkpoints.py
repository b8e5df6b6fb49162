"""Time and peak memory of universal conversion and Hugging Face export on a real checkpoint.

    python benchmarks/bench_checkpoints.py --data DATA_DIR --preset 125M [--config zero2] [--ranks 2]

Trains the preset for one step (seq 32, micro 1) with the given DeepSpeed config and saves, then
runs each tool in a process of its own under GNU time (wall seconds, peak RSS):

    zerostack universal   python -m training.universal RUN --force
    ds_to_universal       DeepSpeed's converter (1 extract and 1 merge worker), for comparison
    zerostack export      python -m training.export RUN --out HF  (reload check included)
    imports only          python -c "import torch, deepspeed, transformers, models, training.export"

The figure of merit is peak RSS over the fp32 weight size (4 bytes a parameter), shown raw and
with the imports-only baseline taken off (what the tool itself holds). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def timed(cmd: list[str], workdir: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of cmd, measured by GNU time."""
    out = workdir / "time.txt"
    p = subprocess.run(
        ["/usr/bin/time", "-f", "%e %M", "-o", str(out), *cmd],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    wall, kb = out.read_text().split()[-2:]
    return float(wall), int(kb) * 1024


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--data", required=True, help="a folder written by `python -m data.prepare`")
    a.add_argument("--preset", default="125M")
    a.add_argument("--config", default="zero2", help="a ds_configs/ name")
    a.add_argument("--ranks", type=int, default=2)
    a.add_argument("--workdir", default=None, help="default: a temporary folder, removed after")
    args = a.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    run = work / "run"
    try:
        if not (run / "checkpoints" / "latest").is_file():
            train = [
                PY, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
                "training/train.py", "--data", args.data, "--out", str(run),
                "--model", args.preset, "--ds_config", f"ds_configs/{args.config}.json",
                "--seq-len", "32", "--micro-batch", "1", "--steps", "1", "--eval-samples", "2",
                "--log-every", "1",
            ]  # fmt: skip
            timed(train, work)
        n_params = json.loads((run / "resolved_config.json").read_text())["n_params"]
        fp32 = 4 * n_params
        tag = (run / "checkpoints" / "latest").read_text().strip()
        ckpt_bytes = sum(f.stat().st_size for f in (run / "checkpoints" / tag).iterdir())

        rows = []
        base = timed(
            [PY, "-c", "import torch, deepspeed, transformers, models, training.export"], work
        )
        rows.append(("imports only", *base))
        rows.append(
            (
                "zerostack universal",
                *timed([PY, "-m", "training.universal", str(run), "--force"], work),
            )
        )
        dsu = work / "dsu" / tag
        shutil.rmtree(dsu.parent, ignore_errors=True)
        rows.append(
            (
                "ds_to_universal",
                *timed(
                    [
                        PY,
                        "-m",
                        "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder",
                        str(run / "checkpoints" / tag),
                        "--output_folder",
                        str(dsu),
                        "--num_extract_workers",
                        "1",
                        "--num_merge_workers",
                        "1",
                    ],  # fmt: skip
                    work,
                ),
            )
        )
        hf = work / "hf"
        shutil.rmtree(hf, ignore_errors=True)
        rows.append(
            (
                "zerostack export",
                *timed([PY, "-m", "training.export", str(run), "--out", str(hf)], work),
            )
        )

        print(
            f"\n{args.preset}: {n_params / 1e6:.1f}M params, fp32 weights {fp32 / 2**20:.0f} MiB, "
            f"checkpoint {ckpt_bytes / 2**20:.0f} MiB ({args.config}, {args.ranks} ranks)\n"
        )
        print("| step | wall s | peak RSS MiB | RSS / fp32 | (RSS - imports) / fp32 |")
        print("|---|---|---|---|---|")
        for name, wall, rss in rows:
            extra = (rss - base[1]) / fp32
            print(f"| {name} | {wall:.1f} | {rss / 2**20:.0f} | {rss / fp32:.2f} | {extra:.2f} |")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
