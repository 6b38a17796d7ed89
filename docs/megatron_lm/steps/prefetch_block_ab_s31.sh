#!/usr/bin/env bash
# One call on one H200 (carry .whl .mlm): what freeing the copy ahead's device block costs.
# 1. benchmarks/probe_block_free.py: the free of an ordinary (empty_cache) and a managed block of
#    2 and 12 GiB, in line, beside a loop of launches, and paced in 256 MiB pieces;
# 2. the ~1B restart repeated (restart_repeat_s28.sh): the copy ahead with the managed block
#    (early_prefetch, freed on a thread at the release), with torch's cached block left in its
#    cache (early_prefetch_cached), without a copy ahead (early_host), and storage.
#   OUT=$OUT bash docs/megatron_lm/steps/prefetch_block_ab_s31.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
timeout 150 python3 benchmarks/probe_block_free.py --gib 2 12 --json "$OUT/block_free.json" 2>&1 | tail -8
OUT=$OUT MODEL=${MODEL:-1b} REPEATS=${REPEATS:-1} \
  MODES="${MODES:-early_prefetch early_prefetch_cached early_host}" \
  bash docs/megatron_lm/steps/restart_repeat_s28.sh
