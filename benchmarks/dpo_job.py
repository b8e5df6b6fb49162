"""The offline preference-tuning job: DPO from the quickstart's model on pairs built from the
built-in corpus, and its held-out preference accuracy before and after.

    python benchmarks/dpo_job.py [--base runs/quickstart/hf] [--pairs 400] [--steps 40]

Steps (each a user's command): `data.instructions --pairs` (each documented function's body
chosen, the next function's body in the same file rejected; whole files to train or
validation), the first --pairs training rows kept, `data.prepare` with the base's tokenizer and
data/templates/plain.jinja, and a 2-rank `training/train.py` DPO run under ZeRO-2 with
--eval-on-start. Writes raw JSON to benchmarks/results/dpo_pyfuncs.json (the eval records of
step 0 and of the last step, the train records, the job's arguments and the host) and prints
a markdown table for docs/finetuning.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.host import host_class
from benchmarks.provenance import today

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="runs/quickstart/hf", help="the model to tune (an HF folder)")
    p.add_argument("--work", default="data_cache/pyprefs", help="folder for the data")
    p.add_argument("--out", default="runs/pyprefs-dpo")
    p.add_argument("--pairs", type=int, default=400, help="training rows kept")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", default="1e-4")
    p.add_argument("--beta", default="0.1")
    p.add_argument("--results", default="benchmarks/results/dpo_pyfuncs.json")
    a = p.parse_args()
    work = Path(a.work)
    run([PY, "-m", "data.instructions", "--source", "pystdlib", "--out", str(work), "--pairs"])
    rows = (work / "train.jsonl").read_text().splitlines(keepends=True)
    (work / "train_head.jsonl").write_text("".join(rows[: a.pairs]))
    data = work / f"prepared-{a.pairs}-{a.seq_len}"
    run([PY, "-m", "data.prepare", "--source", str(work / "train_head.jsonl"),
         "--val-source", str(work / "val.jsonl"), "--tokenizer", a.base,
         "--chat-template", "data/templates/plain.jinja", "--seq-len", str(a.seq_len),
         "--too-long", "drop", "--out", str(data), "--quiet"])  # fmt: skip
    train = [
        "--ds_config", "ds_configs/zero2.json", "--data", str(data), "--model", a.base,
        "--out", a.out, "--seq-len", str(a.seq_len), "--micro-batch", "4", "--steps",
        str(a.steps), "--lr", a.lr, "--warmup", "5", "--objective", "dpo", "--dpo-beta", a.beta,
        "--eval-every", str(a.steps), "--eval-on-start", "--eval-samples", "256",
        "--log-every", "5", "--save-every", "-1",
    ]  # fmt: skip
    run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "training/train.py", *train])
    records = [
        json.loads(line) for line in (Path(a.out) / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in records if r.get("kind") == "eval"]
    manifest = json.loads((data / "manifest.json").read_text())
    result = {
        "date": today(),
        "host": host_class(),
        "args": {**vars(a), "train": train},
        "pairs": manifest["chat"]["pairs"],
        "before": evals[0],
        "after": evals[-1],
        "train": [r for r in records if r.get("kind") == "train"],
    }
    Path(a.results).write_text(json.dumps(result, indent=1) + "\n")
    print("| | held-out DPO loss | reward accuracy | prefers chosen | reward margin |")
    print("|---|---|---|---|---|")
    for name in ("before", "after"):
        r = result[name]
        print(f"| {name} (step {r['step']}) | {r['val_loss']:.4f} | {r['val_accuracy']:.3f} | "
              f"{r['val_prefers_chosen']:.3f} | {r['val_margin']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
