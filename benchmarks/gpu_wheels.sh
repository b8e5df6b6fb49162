#!/usr/bin/env bash
# Run here, before a GPU machine is lent: fills .whl/ (git-ignored, carried to the machine)
# with the wheels its image lacks (benchmarks/gpu_wheels.py lists them, at requirements.lock's
# versions) for Python 3.12 on manylinux x86_64. The machine has no network.
#   bash benchmarks/gpu_wheels.sh        then carry .whl to: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.whl
mkdir -p "$DEST"
TARGET=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps -d "$DEST")

for spec in $($PY -m benchmarks.gpu_wheels binary); do
  $PY -m pip download -q "${TARGET[@]}" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$spec"
done
for spec in $($PY -m benchmarks.gpu_wheels pure); do
  $PY -m pip download -q "${TARGET[@]}" --platform any "$spec"
done
# DeepSpeed ships an sdist only: built against this venv's torch with no ops compiled
# (DS_BUILD_OPS=0), so the GPU machine builds the ones a run needs on first use.
for spec in $($PY -m benchmarks.gpu_wheels built); do
  name=${spec%%==*}
  ls "$DEST"/"$name"-*.whl >/dev/null 2>&1 ||
    DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "$spec" -w "$DEST"
done

ls -l "$DEST"
du -sh "$DEST"
