#!/usr/bin/env bash
# 8 ranks on one GPU, GIB GiB a rank: warm loads verifying on the device (default) and on the host
# (MCX_DEVICE_CRC_TRITON=0), each beside the same load without verification, alternated in one
# call; then the save step of scripts/gpu_node.sh (host memory of the node). From the repository
# root on the GPU machine:  OUT=$OUT bash docs/node/steps/device_sums_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NPROC=${NPROC:-8}; GIB=${GIB:-2}; REPEATS=${REPEATS:-2}
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
for v in ${ORDER:-1 0}; do
  MCX_DEVICE_CRC_TRITON=$v timeout -k 10 200 "${TR[@]}" benchmarks/bench_load.py \
    --ranks-per-device auto --gib "$GIB" --repeats "$REPEATS" --sources ours ours_no_verify \
    --caches warm --out /tmp/node_load --json "$OUT/node_load_triton$v.json" > "$OUT/node_load_triton$v.log" 2>&1
  echo "MCX_DEVICE_CRC_TRITON=$v rc=$?"; grep "bench_load\]" "$OUT/node_load_triton$v.log" | cut -c1-160
  rm -rf /tmp/node_load
done
[[ ${SAVE:-1} == 1 ]] && OUT=$OUT STEPS="save" NPROC=$NPROC GIB=$GIB SAVES=${SAVES:-5} \
  STEP_TIMEOUT=${STEP_TIMEOUT:-270} bash scripts/gpu_node.sh
