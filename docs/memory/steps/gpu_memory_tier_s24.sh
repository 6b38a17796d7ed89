#!/usr/bin/env bash
# Twenty-fourth session, one H200: the memory-tier functional tests with CUDA tensors at one rank
# (the file the twenty-third session left with two failures: the prefetch restore's unregistered
# buffers and one killed-job restart), its log and junit XML under $OUT.
# Run from the repository root with .whl carried:
#   OUT=$OUT bash docs/memory/steps/gpu_memory_tier_s24.sh [pytest args]
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
export MCX_TEST_DEVICE=cuda MCX_TEST_WORLD=1
git rev-parse --short HEAD 2>/dev/null > "$OUT/commit.txt"
timeout 560 python3 -m pytest -v -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" \
  tests/functional/multirank/test_memory_tier.py "$@" 2>&1 | tee "$OUT/tests.log" | tail -60
