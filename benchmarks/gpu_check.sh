#!/usr/bin/env bash
# The one command to run on a lent GPU machine, from the repo root, with .whl/ carried (filled
# beforehand by benchmarks/gpu_wheels.sh): installs the wheels beside the image's packages, then
# runs every row of benchmarks/gpu_check.py within 9 minutes. Results (gpu_check.json,
# gpu_check.md, logs/) go to $OUT, else gpu_check_out/. Extra arguments go to the driver.
#   bash benchmarks/gpu_check.sh [--rows zero2,ddp] [--budget 540]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
mkdir -p "$OUT"
# --no-deps: the image's torch, transformers and numpy stay the ones it was built with.
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2>&1 |
  tee "$OUT/pip_install.log" | tail -3
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH # ninja, for the DeepSpeed ops built on first use
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
exec $PY -m benchmarks.gpu_check --out "$OUT" "$@"
