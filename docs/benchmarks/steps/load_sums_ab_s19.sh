#!/usr/bin/env bash
# One call on one GPU (carry .whl): the A/B the nineteenth session could not run for lack of
# device time. (1) benchmarks/probe_load_variants.py on an 8 GiB state: chunks under 1 MiB summed
# on the host (_M1024, load_sums.DEVICE_MIN_BYTES) against every chunk launched on the device (the
# default), with
# 32 and 64 MiB chunks, at 8 and 16 reading threads, three loads a variant in each of two blocks;
# (2) the load benchmark at the default settings, warm and cold, with megatron-core beside it.
# Results under $OUT: <card>_load_sums_ab.json/.log, <card>_load_8gib_after_sums.json/.log.
# From the repository root:  OUT=$OUT bash docs/benchmarks/steps/load_sums_ab_s19.sh
# Ran in the twentieth session at 583641b; its _M1024 variants need that code (the host sums of
# small chunks were taken out after this A/B showed no gain).
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node 1)
timeout 320 "${TR[@]}" benchmarks/probe_load_variants.py --gib 8 --repeats 3 --loop-chunks 32 \
  --variants T8_C32_F1 T8_C32_F1_M1024 T8_C64_F1 T8_C64_F1_M1024 T16_C32_F1 T16_C32_F1_M1024 T16_C64_F1_M1024 \
  --json "$OUT/${CARD}_load_sums_ab.json" 2>&1 | grep -v "^\[W\|Warning" \
  > "$OUT/${CARD}_load_sums_ab.log"
grep "_verify\|_plain\|loop" "$OUT/${CARD}_load_sums_ab.log"
timeout 200 "${TR[@]}" benchmarks/bench_load.py --gib 8 --repeats 2 \
  --sources ours ours_no_verify megatron --out /tmp/load8_after_sums \
  --json "$OUT/${CARD}_load_8gib_after_sums.json" 2>&1 | grep "bench_load\|Error" \
  | tee "$OUT/${CARD}_load_8gib_after_sums.log"
