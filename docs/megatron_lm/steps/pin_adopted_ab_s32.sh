#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): does pinning the restored snapshot (1.88 GB at 134M,
# 0.15 s of cudaHostRegister on several threads, started as our load returns) slow the rest of
# Megatron-LM's load_checkpoint? The 134M restart from memory repeated (restart_repeat_s28.sh),
# with the defaults (early_default) and with the pinning left to after the first training step
# (early_pinstep: MCX_PIN_ADOPTED=step), and from storage, REPEATS rounds.
#   OUT=$OUT bash docs/megatron_lm/steps/pin_adopted_ab_s32.sh
# Ran at eb7beb0, the only commit with MCX_PIN_ADOPTED and restart_repeat_s28.sh's mode
# early_pinstep (taken out after it: docs/MEMORY.md, thirty-second session); to rerun it,
# check that commit out.
set -uo pipefail
grep -q MCX_PIN_ADOPTED megatron_ckpt_ext/debug.py || {
  echo "pin_adopted_ab_s32.sh: MCX_PIN_ADOPTED is not in this code; run it at eb7beb0"; exit 2; }
source docs/megatron_lm/steps/_prologue.sh
OUT=$OUT MODEL=${MODEL:-134m} REPEATS=${REPEATS:-3} MODES="${MODES:-early_default early_pinstep}" \
  bash docs/megatron_lm/steps/restart_repeat_s28.sh
