#!/usr/bin/env bash
# One host, N ranks, through DeepSpeed's launcher (it passes --local_rank to each rank).
#   launch/local.sh NUM_RANKS [train.py flags...]
#   launch/local.sh 2 --ds_config ds_configs/zero3.json --data data_cache/pystdlib --out runs/z3
# On GPUs NUM_RANKS is the GPU count (NCCL); on CPU it is the number of processes (gloo), each
# given an equal share of the cores.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: launch/local.sh NUM_RANKS [train flags...]}; shift
exec .venv/bin/deepspeed --num_gpus "$n" --master_port "${MASTER_PORT:-29500}" training/train.py "$@"
