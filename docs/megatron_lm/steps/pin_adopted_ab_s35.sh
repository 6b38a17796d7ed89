#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): is it the pinning of the restored snapshot that makes
# Megatron-LM's own steps of load_checkpoint twice as long after a restore from memory as after
# a storage load (thirty-fifth session: 101 against 45-50 ms at 134M, 184 against 78-82 ms at
# ~1B)? Since the thirty-third session nothing else of ours runs beside those steps (the first
# save's preparation moved to after the first training step); the thirty-second session's A/B of
# the same question still had that preparation there in both arms. The restart repeated
# (restart_repeat_s28.sh), alternated: early_default (pinned as the load returns), early_pinstep
# (MCX_PIN_ADOPTED=step: pinned by the preparation after the first training step), and storage.
# Per restart the line has Megatron's load-checkpoint timer and our load's load_s: Megatron's part
# is their difference. REST_PROBE=1 adds the timers of Megatron's own steps (which of them the
# pinning slows, if any: the model's and the optimizer's load_state_dict in the twelfth session).
# Run in the thirty-sixth session (docs/MEMORY.md): yes; since then the default is the pinning
# after the first step, and the arms are named for the switch (early_pinload, early_pinstep).
#   OUT=$OUT [MODEL=134m REPEATS=3 REST_PROBE=1] bash docs/megatron_lm/steps/pin_adopted_ab_s35.sh
set -uo pipefail
OUT=$OUT MODEL=${MODEL:-134m} REPEATS=${REPEATS:-3} MODES="${MODES:-early_pinload early_pinstep}" \
  bash docs/megatron_lm/steps/restart_repeat_s28.sh
