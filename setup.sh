#!/usr/bin/env bash
# Creates .venv/ with zerostack installed editable (pip install -e .) and everything it needs;
# safe to run again (it then only checks). torch is installed first and DeepSpeed without build
# isolation, so DeepSpeed's build never pulls a second (CUDA) torch on a CPU machine.
# requirements.lock (the tested versions, .ci/lock regenerates it) constrains the rest; a plain
# `pip install -e .` without it takes the ranges of pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.zerostack-requirements
inputs=(requirements.txt pyproject.toml)
lock=()  # no lock only while regenerating it (.ci/lock): then the newest versions in the ranges
if [ -f requirements.lock ]; then
  inputs+=(requirements.lock)
  lock=(-c requirements.lock)
fi
if [ ! -f "$stamp" ] || ! cat "${inputs[@]}" | cmp -s - "$stamp"; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q ${lock[@]+"${lock[@]}"} \
    "$(grep -E '^torch==' requirements.txt)" numpy "setuptools>=64" wheel
  .venv/bin/python -m pip install -q --no-build-isolation ${lock[@]+"${lock[@]}"} -e ".[dev]"
  cat "${inputs[@]}" > "$stamp"
fi
.venv/bin/python -c "import torch, deepspeed, transformers; print(f'zerostack env: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')" 2>/dev/null
