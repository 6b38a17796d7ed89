#!/usr/bin/env bash
# One call on a multi-GPU kind (carry .whl): the node's warm load, 8 ranks x 8 GiB (ranks spread
# over the GPUs as bench_load's --ranks-per-device auto does), with 32 MiB and then 64 MiB read
# pieces (--chunk-mib), verifying and not, warm only, two repeats each; floors (warm read,
# host-to-device, the host's own read-and-copy loop) measured in each run.
# Results under $OUT: <card>_8ranks_8gib_load_c<MiB>.json/.log.
# From the repository root:  OUT=$OUT bash docs/node/steps/x4_chunk_ab_s20.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NPROC=${NPROC:-8}
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
nvidia-smi -L | head -8
for C in ${CHUNKS:-32 64}; do
  timeout -k 10 ${STEP_TIMEOUT:-260} "${TR[@]}" benchmarks/bench_load.py --gib 8 --repeats 2 \
    --caches warm --sources ours ours_no_verify --no-first-load --chunk-mib "$C" \
    --out /tmp/node_load_c$C --json "$OUT/${CARD}_${NPROC}ranks_8gib_load_c$C.json" \
    > "$OUT/${CARD}_${NPROC}ranks_8gib_load_c$C.log" 2>&1
  echo "chunk $C MiB rc=$?"
  grep "bench_load\|Error" "$OUT/${CARD}_${NPROC}ranks_8gib_load_c$C.log" | tail -8
  rm -rf /tmp/node_load_c$C
done
