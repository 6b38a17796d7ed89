#!/usr/bin/env bash
# One call on one GPU (carry .whl): reading threads at 64 MiB pieces, verifying and not, on an
# 8 GiB state (benchmarks/probe_load_variants.py: the load's own code, variants alternated, three
# loads a variant in each of two blocks, the host's own read-and-copy loop beside it).
# From the repository root:  OUT=$OUT bash docs/benchmarks/steps/load_threads_ab_s21.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  benchmarks/probe_load_variants.py --gib 8 --repeats 3 --loop-chunks 64 \
  --variants T8_C64_F1 T12_C64_F1 T16_C64_F1 \
  --json "$OUT/${CARD}_load_threads_ab_s21.json" 2>&1 | grep -v "^\[W\|Warning" \
  > "$OUT/${CARD}_load_threads_ab_s21.log"
grep "_verify\|_plain\|loop" "$OUT/${CARD}_load_threads_ab_s21.log"
