#!/usr/bin/env bash
# torchrun on one host, or on many with c10d rendezvous. Same train.py, any --backend.
#   launch/torchrun.sh NUM_RANKS_PER_HOST [train.py flags...]
#   NNODES=2 RDZV_HOST=node1 launch/torchrun.sh 8 --backend fsdp --data ... --out ...   (run on every host)
# Many hosts (c10d rendezvous, no ssh): start the same command on every host, within a few
# minutes of each other. Needs on every host: this repo with its .venv at any path, the data, and
# --out on storage all hosts see; RDZV_HOST (any one of the hosts, by a name or address all of
# them reach) accepting TCP on RDZV_PORT (29400); the same RDZV_ID for one job and a new one for
# the next. Set GLOO_SOCKET_IFNAME (CPUs) or NCCL_SOCKET_IFNAME (GPUs) to the interface between
# the hosts when they have several. VENV=DIR names another virtualenv than this repo's .venv.
# Restarts a failed job up to MAX_RESTARTS times; each restart resumes from the latest
# complete checkpoint in --out.
# Elastic: NNODES=MIN:MAX (e.g. 1:2) with MAX_RESTARTS>0 lets the job go on when a host is lost
# (the survivors restart on the smaller world, from the last checkpoint, through the universal
# resume; give --global-batch and not --grad-accum, so accumulation makes up the lost ranks)
# and grow back when the host's command is started again (the running ranks save and restart
# with it). RDZV_HOST must be a host that stays. RDZV_CONF goes to --rdzv-conf (e.g.
# last_call_timeout=5,keep_alive_interval=2). docs/reliability.md: "A lost host".
# SIGTERM, SIGUSR1 or Ctrl-C to torchrun reach every rank, which saves a checkpoint at the next
# step boundary and exits (75); torchrun waits SHUTDOWN_TIMEOUT seconds (default 120) for that
# before it kills them.
# The script exits with the code the ranks recorded (RUN/exit.json, training/errors.py): torchrun
# itself says 1 for any failed rank.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/wait.sh
n=${1:?usage: launch/torchrun.sh NUM_RANKS_PER_HOST [train flags...]}; shift
args=(--nproc_per_node "$n" --max-restarts "${MAX_RESTARTS:-0}"
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}")
nnodes=${NNODES:-1}
if [ "$nnodes" != 1 ] && [ "$nnodes" != 1:1 ]; then
  args+=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "${RDZV_HOST:?set RDZV_HOST}:${RDZV_PORT:-29400}" --rdzv-id "${RDZV_ID:-zerostack}")
  if [ -n "${RDZV_CONF:-}" ]; then args+=(--rdzv-conf "$RDZV_CONF"); fi
  # torchrun's shared TCP store (torch 2.4+) deadlocks a round that a new host joins: the rank-0
  # agent keeps the first round's master address, and the newcomer waits for it in the new one.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
else
  args+=(--standalone)
fi
venv=${VENV:-.venv}
record=$(mktemp "${TMPDIR:-/tmp}/zerostack-exit.XXXXXX")
trap 'rm -f "$record"' EXIT
export ZEROSTACK_EXIT_RECORD=$record ZEROSTACK_LAUNCH_ID="torchrun-$$-$(date +%s%N)"
# In a session of its own, so a Ctrl-C in the terminal reaches it once, through the trap below.
setsid "$venv/bin/torchrun" "${args[@]}" training/train.py "$@" &
child=$!
for sig in TERM INT USR1 HUP QUIT; do  # torchrun passes these on to every rank
  trap "kill -s $sig $child 2>/dev/null" "$sig"
done
wait_launcher "$child" "$@"
exit "$code"
