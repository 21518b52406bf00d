#!/usr/bin/env bash
# Start `sparse-rl train` on this node under torchrun: one call per node, the same arguments on every node.
#
#   launch/torchrun.sh --config configs/recipes/qwen2.5-3b/rkv.yaml [key.path=value ...]     # one node
#   NNODES=2 RDZV_ENDPOINT=node01:29500 launch/torchrun.sh --config RECIPE [...]            # on each of 2 nodes
#
# First `sparse-rl preflight` checks this node (recipe, model and data present, GPU count vs TP x PP x DP, the
# rendezvous endpoint reachable) and prints the rollout layout line, e.g. `rollout: 16 sglang engines x TP1 on ranks
# 0-15 (2 nodes x GPUs 0-7), 128 groups -> 8 per engine`; then torchrun starts NPROC_PER_NODE ranks that meet at the
# c10d rendezvous. Each node starts its own share of the engines: one per rollout.gpus_per_engine ranks, in the
# first rank of each group, on that group's GPUs (LOCAL_RANK = GPU; its ranks must see all the node's GPUs), and
# that rank samples and scores its share of every step's groups. Every phase of every step prints a time-stamped
# heartbeat line (log.heartbeat=true, always on here), so a hang says where.
#
# Environment:
#   NNODES          nodes of the job (default 1)
#   NPROC_PER_NODE  ranks on this node (default: the GPUs nvidia-smi lists, else 1)
#   RDZV_ENDPOINT   HOST:PORT of the rendezvous, the same on every node (default 127.0.0.1:29500; multi-node:
#                   the first node's address)
#   RDZV_ID         rendezvous id, the same on every node (default sparse-rl; Slurm: the job id)
#   PYTHON          interpreter (default: the project's .venv, else python3)
#   SKIP_PREFLIGHT  1 to skip the checks
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
NNODES="${NNODES:-1}"
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=1
  if command -v nvidia-smi >/dev/null 2>&1 && gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" && [ "$gpus" -gt 0 ]; then
    NPROC_PER_NODE="$gpus"
  fi
fi
RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:29500}"
RDZV_ID="${RDZV_ID:-sparse-rl}"

echo "[launch] $(date '+%F %T') $(hostname): $NNODES node(s) x $NPROC_PER_NODE rank(s), rendezvous $RDZV_ENDPOINT ($RDZV_ID)"
# A stop (SIGTERM: kill, scancel, pre-emption; SIGINT: Ctrl-C) is passed to the ranks, which save at the end of
# their current step and exit 0; then this script says so in one line and exits 0. torchrun itself runs with
# SIGTERM and SIGINT ignored: its own handling would give the ranks 30 s, kill them and exit 1 with a traceback
# however cleanly they stopped. Its exit status is the ranks' (0 only if every rank exited 0), so a real failure
# stays non-zero. A second Ctrl-C aborts (the ranks exit without saving; the last checkpoint stays complete).
stop_signal=""
torchrun_pid=""
resender=""
# shellcheck disable=SC2317  # run by the traps
on_stop() {
  if [ -z "$stop_signal" ]; then
    echo "[launch] $(date '+%F %T') SIG$1 received: the ranks stop after their current step, with a checkpoint"
  fi
  stop_signal="$1"
  interrupted=1
  if [ -n "$torchrun_pid" ]; then
    pkill "-$1" -P "$torchrun_pid" 2>/dev/null || true  # the ranks: torchrun's children
    if [ -z "$resender" ]; then  # again every 5 s (as TERM: a repeat changes nothing), for ranks still starting
      (while kill -0 "$torchrun_pid" 2>/dev/null; do
         sleep 5
         pkill -TERM -P "$torchrun_pid" 2>/dev/null || true
       done) &
      resender=$!
    fi
  fi
}
trap 'on_stop TERM' TERM
trap 'on_stop INT' INT
preflight=0
if [ "${SKIP_PREFLIGHT:-0}" != 1 ]; then
  "$PYTHON" -m sparse_rl_megatron.cli preflight --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-endpoint "$RDZV_ENDPOINT" "$@" || preflight=$?
fi
if [ -n "$stop_signal" ]; then
  echo "[launch] $(date '+%F %T') stopped on request (SIG$stop_signal) before the ranks started"
  exit 0
fi
[ "$preflight" = 0 ] || exit "$preflight"
(
  trap '' TERM INT
  exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" --signals-to-handle SIGHUP,SIGQUIT \
    --module sparse_rl_megatron.cli train "$@" log.heartbeat=true
) &
torchrun_pid=$!
# bash runs a trap only between commands: a trap interrupts `wait` (status > 128), so wait again until torchrun's
# own status comes back (if torchrun ended meanwhile, bash still holds its status for the next wait)
while true; do
  interrupted=0
  if wait "$torchrun_pid"; then status=0; break; else status=$?; fi
  if [ "$interrupted" != 1 ] || [ "$status" -le 128 ]; then break; fi
done
if [ -n "$resender" ]; then pkill -P "$resender" 2>/dev/null || true; kill "$resender" 2>/dev/null || true; fi
if [ -n "$stop_signal" ]; then
  if [ "$status" = 0 ]; then
    echo "[launch] $(date '+%F %T') stopped on request (SIG$stop_signal): every rank saved and exited 0; run the" \
         "same command to resume"
  else
    echo "[launch] $(date '+%F %T') stop requested (SIG$stop_signal), but the ranks did not all exit 0 (status" \
         "$status); the newest complete checkpoint is the one to resume from"
  fi
fi
exit "$status"
