#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, prepare the built-in corpus (the Python
# standard library's source, found on the machine), train the `small` preset with DeepSpeed
# ZeRO-2 (examples/quickstart.yaml) on every GPU the machine has, else on 2 CPU ranks (bf16
# where the device runs it fast, else fp32 on a CPU: the config's precision is "auto"),
# validating as it goes, export to a Hugging Face folder, and sample from it with stock
# transformers. Re-running resumes / reuses what is already done.
#   STEPS=400 RANKS=2 MICRO_BATCH=8 ./quickstart.sh
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh
PY=.venv/bin/python
DATA=${DATA:-data_cache/pystdlib}
RUN=${RUN:-runs/quickstart}
STEPS=${STEPS:-200}
# One rank per GPU where the machine has GPUs, else 2 CPU ranks (RANKS=N says otherwise).
if [ -z "${RANKS:-}" ]; then
  GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  RANKS=$(( GPUS > 0 ? GPUS : 2 ))
fi

echo "== 1/4 prepare the built-in corpus -> $DATA"
$PY -m data.prepare --source pystdlib --out "$DATA" --vocab-size 8192 --num-proc 2

echo "== 2/4 train: small preset, ds_configs/zero2.json, $RANKS ranks, precision auto, $STEPS steps -> $RUN"
# The job is the run file examples/quickstart.yaml; the flags given override it.
.venv/bin/deepspeed --num_gpus "$RANKS" --master_port "${MASTER_PORT:-29510}" training/train.py \
  --config examples/quickstart.yaml --data "$DATA" --out "$RUN" \
  --steps "$STEPS" --micro-batch "${MICRO_BATCH:-4}"

echo "== 3/4 export to a Hugging Face folder -> $RUN/hf"
$PY -m training.export "$RUN" --out "$RUN/hf" --overwrite

echo "== 4/4 sample from the exported model with stock transformers"
$PY -m training.sample "$RUN/hf" --prompt "def read_config(path):" --max-new-tokens 80
echo
echo "Done: metrics in $RUN/metrics.jsonl, loss curve $RUN/loss.png, TensorBoard $RUN/tensorboard, model $RUN/hf"
