#!/usr/bin/env bash
# One host, N ranks, through DeepSpeed's launcher (it passes --local_rank to each rank).
#   launch/local.sh NUM_RANKS [train.py flags...]
#   launch/local.sh 2 --ds_config ds_configs/zero3.json --data data_cache/pystdlib --out runs/z3
#   MAX_RESTARTS=3 launch/local.sh 2 ...     start a failed run again, up to 3 times
# On GPUs NUM_RANKS is the GPU count (NCCL); on CPU it is the number of processes (gloo), each
# given an equal share of the cores.
#
# The script exits with the code the ranks recorded (RUN/exit.json, training/errors.py), not the
# DeepSpeed launcher's own (which, after a lost rank, is the dead rank's: -9 -> 247).
# Restarts resume from the latest complete checkpoint in --out. Exit codes 2 (bad input),
# 3 (diverged) and 5 (could not save) are not retried: they would fail the same way again
# (training/errors.py lists them all). SIGTERM, SIGUSR1 or Ctrl-C to this script go to the
# ranks themselves (DeepSpeed's launcher would kill them instead): they save a checkpoint at
# the next step boundary and exit with 75, and the script stops.
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/wait.sh
n=${1:?usage: launch/local.sh NUM_RANKS [train flags...]}; shift
venv=${VENV:-.venv}
max=${MAX_RESTARTS:-0}
child=
stopping=0

forward() {  # the ranks are the children of launch.py, the launcher's own child
  stopping=1
  local launcher
  for launcher in $(pgrep -P "$child" 2>/dev/null); do
    pkill "-$1" -P "$launcher" 2>/dev/null
  done
}
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT

record=$(mktemp "${TMPDIR:-/tmp}/zerostack-exit.XXXXXX")
trap 'rm -f "$record"' EXIT
export ZEROSTACK_EXIT_RECORD=$record

attempt=0
while :; do
  : > "$record"
  export ZEROSTACK_LAUNCH_ID="local-$$-$attempt-$(date +%s%N)"
  "$venv/bin/deepspeed" --num_gpus "$n" --master_port "${MASTER_PORT:-29500}" \
    training/train.py "$@" &
  child=$!
  wait_launcher "$child" "$@"
  if [ "$stopping" = 1 ] || [ "$code" = 0 ]; then exit "$code"; fi
  case $code in 2 | 3 | 5) exit "$code" ;; esac
  if [ "$attempt" -ge "$max" ]; then exit "$code"; fi
  attempt=$((attempt + 1))
  echo "local.sh: the run exited with code $code; restarting ($attempt of $max)," \
    "it resumes from the latest complete checkpoint" >&2
done
