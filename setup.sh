#!/usr/bin/env bash
# Creates .venv/ with everything zerostack needs; safe to run again (it then only checks).
# torch is installed first and DeepSpeed without build isolation, so DeepSpeed's build never
# pulls a second (CUDA) torch on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.zerostack-requirements
if [ ! -f "$stamp" ] || ! cmp -s requirements.txt "$stamp"; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "$(grep -E '^torch==' requirements.txt)" numpy
  .venv/bin/python -m pip install -q --no-build-isolation -r requirements.txt
  cp requirements.txt "$stamp"
fi
.venv/bin/python -c "import torch, deepspeed, transformers; print(f'zerostack env: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')" 2>/dev/null
