#!/usr/bin/env bash
# Many hosts through DeepSpeed's launcher: pdsh over ssh by default (LAUNCHER=openmpi for MPI).
#   launch/hostfile.sh HOSTFILE MASTER_ADDR [train.py flags...]
#   GLOO_SOCKET_IFNAME=eth0 launch/hostfile.sh launch/hostfile.example node1 \
#       --ds_config ds_configs/zero3.json --data DATA --out RUN
#
# Needs on the launching host: pdsh (apt-get install pdsh) and passwordless ssh to every host in
# HOSTFILE, under the names written there (DeepSpeed checks `ssh HOST hostname` first).
# Needs on every host: sshd, this repo at the same path with its .venv (bash setup.sh), and the
# data folder and --out on storage every host sees (or the same path on each). MASTER_ADDR is
# the first host's name or address as the other hosts reach it.
#
# HOSTFILE: one line per host, "NAME slots=N" (N ranks there: GPUs, or processes on a CPU host);
# see launch/hostfile.example. Each host runs `deepspeed.launcher.launch` with --node_rank from
# its line's position, so every rank gets RANK, LOCAL_RANK and WORLD_SIZE.
#
# Environment: the launcher forwards only variables starting with PYTHON, MV2, UCX or MLFLOW to
# remote ranks, plus the NAME=value lines of an env file: ./.deepspeed_env (or the file named by
# DS_ENV_FILE). This script writes that file afresh at every launch from the variables below that
# are set here, plus any names listed in FORWARD_VARS:
#   GPUs:  NCCL_SOCKET_IFNAME (the interface between hosts), NCCL_IB_DISABLE, NCCL_DEBUG
#   CPUs:  GLOO_SOCKET_IFNAME (gloo otherwise picks the interface of the hostname), OMP_NUM_THREADS
#   all:   TORCH_EXTENSIONS_DIR (DeepSpeed's compiled ops), HF_HOME, HF_HUB_OFFLINE, WANDB_MODE,
#          TOKENIZERS_PARALLELISM
# Remote ranks run with the same virtualenv activated (--venv_script), so they find its tools:
# this repo's .venv, or VENV=DIR.
# Stopping: Ctrl-C makes DeepSpeed's runner run `pkill -f training/train.py` on every host.
# The script exits with the code the ranks recorded in RUN/exit.json (training/errors.py; --out on
# storage this host sees), else with the launcher's own.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/wait.sh
usage="usage: launch/hostfile.sh HOSTFILE MASTER_ADDR [train flags...]"
hostfile=${1:?$usage}
master=${2:?$usage}
shift 2
[ -f "$hostfile" ] || { echo "error: hostfile not found: $hostfile" >&2; exit 2; }
# Every host must resolve here (DeepSpeed's launcher otherwise dies with a traceback).
hosts=0
while read -r host _; do
  case "$host" in ''|\#*) continue ;; esac
  getent hosts "$host" >/dev/null || {
    echo "error: hostfile $hostfile: host '$host' does not resolve" >&2; exit 2; }
  hosts=$((hosts + 1))
done < "$hostfile"
# One host (a one-node SLURM job): DeepSpeed starts the ranks here itself, no ssh nor pdsh.
one_host=
[ "$hosts" -gt 1 ] || one_host=--no_ssh_check
[ -n "$one_host" ] || command -v pdsh >/dev/null || [ -n "${LAUNCHER:-}" ] || {
  echo "error: pdsh not found on this host (apt-get install pdsh), or set LAUNCHER=openmpi" >&2
  exit 2
}
venv=$(cd "${VENV:-.venv}" && pwd)
env_file=${DS_ENV_FILE:-.deepspeed_env}
: > "$env_file.new"
record=$(mktemp "${TMPDIR:-/tmp}/zerostack-exit.XXXXXX")
trap 'rm -f "$record"' EXIT
export ZEROSTACK_EXIT_RECORD=$record ZEROSTACK_LAUNCH_ID="hostfile-$(hostname)-$$-$(date +%s%N)"
for v in NCCL_SOCKET_IFNAME NCCL_IB_DISABLE NCCL_DEBUG GLOO_SOCKET_IFNAME OMP_NUM_THREADS \
  TORCH_EXTENSIONS_DIR HF_HOME HF_HUB_OFFLINE WANDB_MODE TOKENIZERS_PARALLELISM \
  ZEROSTACK_LAUNCH_ID ${FORWARD_VARS:-}; do
  if [ -n "${!v:-}" ]; then echo "$v=${!v}" >> "$env_file.new"; fi
done
mv "$env_file.new" "$env_file"
export DS_ENV_FILE="$env_file"
# In a session of its own, so a Ctrl-C in the terminal reaches it once, through the trap below.
setsid "$venv/bin/deepspeed" --hostfile "$hostfile" --master_addr "$master" \
  --master_port "${MASTER_PORT:-29500}" --venv_script "$venv/bin/activate" $one_host \
  ${LAUNCHER:+--launcher "$LAUNCHER"} training/train.py "$@" &
child=$!
for sig in TERM INT; do  # DeepSpeed's runner stops the ranks itself
  trap "kill -s $sig $child 2>/dev/null" "$sig"
done
wait_launcher "$child" "$@"
exit "$code"
