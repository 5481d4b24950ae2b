#!/usr/bin/env bash
# Several jdp processes on one host (e.g. one per GPU group, or fake CPU devices for a rehearsal).
#   bash launch_local.sh [PROCESSES] [DEVICES_PER_PROCESS] [CONFIG]     (python -m jdp.examples prints its folder)
# Every process runs the same command; process 0 hosts the coordinator. SIGTERM/SIGINT to this
# script reaches every process, which then save one checkpoint together and exit 0.
set -euo pipefail
processes=${1:-2}
devices=${2:-2}
config=${3:-digits_mlp}  # a shipped config's name, or a file
port=${JDP_PORT:-12345}
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' INT TERM
for ((i = 0; i < processes; i++)); do
  jdp train "$config" --workdir runs/local_mp --devices "$devices" --no-progress \
    --coordinator "127.0.0.1:$port" --num-processes "$processes" --process-id "$i" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
