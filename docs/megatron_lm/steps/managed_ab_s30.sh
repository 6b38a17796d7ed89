#!/usr/bin/env bash
# One call on one H200 (carry .whl .mlm .ab_old; .ab_old = the package before the managed block,
# git archive c572a6a megatron_ckpt_ext): the copy-ahead block in managed memory.
# 1. the GPU test that the block gives way to allocations beyond what was free beside it, and
#    the same test with an ordinary block put in its place (expected: out of memory);
# 2. the 134M restart repeated: the copy ahead with the managed block (early_prefetch), with the
#    ordinary block (old_early_prefetch), without it (early_host), and beside the model build,
#    stopped when the load comes (build_prefetch); storage in each round.
#   OUT=$OUT bash docs/megatron_lm/steps/managed_ab_s30.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
MCX_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/multirank/test_cuda_load.py -k gives_way 2>&1 | tail -3 | tee "$OUT/gpu_test.txt"
timeout 120 python3 - <<'PY' 2>&1 | tail -3 | tee -a "$OUT/gpu_test.txt"
import torch
from megatron_ckpt_ext.load import managed_block as mb
from tests.functional.multirank import test_cuda_load as t
mb.managed_block = lambda n, d: torch.empty(n, dtype=torch.uint8, device=d)  # the contrast
try:
    t.test_the_copy_aheads_block_gives_way_to_the_model_built_beside_it()
    print("contrast (ordinary block): PASSED - the test cannot fail")
except torch.OutOfMemoryError as e:
    print("contrast (ordinary block): out of memory, as expected:", str(e).splitlines()[0][:120])
PY
OUT=$OUT MODEL=134m REPEATS=${REPEATS:-2} \
  MODES="${MODES:-early_prefetch old_early_prefetch early_host build_prefetch}" \
  bash docs/megatron_lm/steps/restart_repeat_s28.sh
