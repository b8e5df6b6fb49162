#!/usr/bin/env bash
# Many hosts through DeepSpeed's launcher (pdsh over ssh by default).
#   launch/hostfile.sh HOSTFILE MASTER_ADDR [train.py flags...]
#
# Needs on every host: this repo at the same path with its .venv (bash setup.sh), passwordless
# ssh from the launching host, and pdsh on the launching host. The data folder and --out must
# be on storage every host sees (or the same path on each).
#
# Environment: the launcher forwards only a few variable prefixes to remote ranks, so put what
# the ranks need into ./.deepspeed_env (one NAME=value a line). This script writes the usual
# ones there if they are set here:
#   GPUs:  NCCL_SOCKET_IFNAME (the interface between hosts), NCCL_IB_DISABLE, NCCL_DEBUG=INFO
#   CPUs:  GLOO_SOCKET_IFNAME (gloo picks the hostname's interface otherwise), OMP_NUM_THREADS
set -euo pipefail
cd "$(dirname "$0")/.."
hostfile=${1:?usage: launch/hostfile.sh HOSTFILE MASTER_ADDR [train flags...]}
master=${2:?usage: launch/hostfile.sh HOSTFILE MASTER_ADDR [train flags...]}
shift 2
: > .deepspeed_env.new
for v in NCCL_SOCKET_IFNAME NCCL_IB_DISABLE NCCL_DEBUG GLOO_SOCKET_IFNAME OMP_NUM_THREADS PYTHONPATH; do
  [ -n "${!v:-}" ] && echo "$v=${!v}" >> .deepspeed_env.new
done
mv .deepspeed_env.new .deepspeed_env
exec .venv/bin/deepspeed --hostfile "$hostfile" --master_addr "$master" \
  --master_port "${MASTER_PORT:-29500}" ${LAUNCHER:+--launcher "$LAUNCHER"} training/train.py "$@"
