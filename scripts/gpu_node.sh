#!/usr/bin/env bash
# The node-shaped run on the GPUs that are lent, in one call: NPROC ranks on this host (default 8),
# RPD ranks per device (default auto: all on one GPU when one is visible, one GPU each on an
# 8-GPU host), each rank its own process:
#   1. tools/node_checks.py   admission fits / refused, a killed writer, SIGTERM + retention
#   2. benchmarks/bench_ckpt.py  ours vs upstream's cpu-shm mode, GIB GiB per rank
#   3. benchmarks/bench_load.py  warm and cold loads, verifying, GIB GiB per rank
# Each step is bounded (STEP_TIMEOUT s) and writes its JSON under $OUT; a step that fails does
# not stop the next. Run from the repository root after the lead's install line:
#   OUT=$OUT bash scripts/gpu_node.sh                   # 8 ranks, 1 GiB each
#   OUT=$OUT NPROC=8 GIB=2 SAVES=5 bash scripts/gpu_node.sh
#   STEPS="save load" ...: only those steps (default "checks save load")
#   SAVE_ARGS / LOAD_ARGS: more arguments for bench_ckpt.py / bench_load.py (e.g.
#   LOAD_ARGS="--sources ours ours_no_verify megatron --caches warm")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
NPROC=${NPROC:-8}
RPD=${RPD:-auto}
GIB=${GIB:-1}
SAVES=${SAVES:-5}
STEP_TIMEOUT=${STEP_TIMEOUT:-280}
DEVICE=${DEVICE:-cuda}  # cpu: a dry run of the same steps on this host
WORK=${WORK:-/tmp/gpu_node}
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK"
START=$(date +%s)
run() {  # NAME -- command...: bounded, logged to $OUT/NAME.log
  local name=$1; shift 2
  timeout -k 10 "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?  # before any command substitution resets it
  echo "[$(( $(date +%s) - START ))s] $name rc=$rc"
  tail -3 "$OUT/$name.log"
}
STEPS=" ${STEPS:-checks save load} "
want() { [[ $STEPS == *" $1 "* ]]; }
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
want checks && run node_checks -- "${TR[@]}" tools/node_checks.py --out "$WORK/checks" \
  --device "$DEVICE" --ranks-per-device "$RPD"
cp "$WORK/checks/node_checks.json" "$OUT/" 2>/dev/null
want save && run bench_save -- "${TR[@]}" benchmarks/bench_ckpt.py --device "$DEVICE" \
  --ranks-per-device "$RPD" --gib-per-rank "$GIB" --saves "$SAVES" \
  --modes ours-async-persistent-cpu-shm megatron-async-persistent-cpu-shm \
  --out "$WORK/save" --json "$OUT/node_save.json" ${SAVE_ARGS:-}
rm -rf "$WORK/save"
want load && run bench_load -- "${TR[@]}" benchmarks/bench_load.py --ranks-per-device "$RPD" \
  --gib "$GIB" --repeats 2 --out "$WORK/load" --json "$OUT/node_load.json" ${LOAD_ARGS:-}
rm -rf "$WORK"
echo "[$(( $(date +%s) - START ))s] done"
