#!/usr/bin/env bash
# torchrun on one host, or on many with c10d rendezvous. Same train.py, any --backend.
#   launch/torchrun.sh NUM_RANKS_PER_HOST [train.py flags...]
#   NNODES=2 RDZV_HOST=node1 launch/torchrun.sh 8 --backend fsdp --data ... --out ...   (run on every host)
# Restarts a failed job up to MAX_RESTARTS times; each restart resumes from the latest
# complete checkpoint in --out. SIGTERM, SIGUSR1 or Ctrl-C to torchrun reach every rank, which
# saves a checkpoint at the next step boundary and exits (75); torchrun waits SHUTDOWN_TIMEOUT
# seconds (default 120) for that before it kills them.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: launch/torchrun.sh NUM_RANKS_PER_HOST [train flags...]}; shift
args=(--nproc_per_node "$n" --max-restarts "${MAX_RESTARTS:-0}"
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}")
if [ "${NNODES:-1}" -gt 1 ]; then
  args+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "${RDZV_HOST:?set RDZV_HOST}:${RDZV_PORT:-29400}" --rdzv-id "${RDZV_ID:-zerostack}")
else
  args+=(--standalone)
fi
exec .venv/bin/torchrun "${args[@]}" training/train.py "$@"
