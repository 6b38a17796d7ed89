#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): what preparing a restore beside the model build costs
# the build and saves the load. The real client at 134M, ours only (train, warm resume, kill -9
# after the committed save at 200 and the relaunch, the warm storage load of a copy), twice:
# MCX_PREPARE_RESTORE=1 (the default) then 0 (docs/DEBUGGING.md). Per run: Megatron's
# model-and-optimizer-setup and load-checkpoint timers and our line "before the model build"
# (INFO when this ran at 32e2ef1; DEBUG since 9431f9b: --logging-level 10 shows it).
#   OUT=$OUT bash docs/megatron_lm/steps/prepare_ab_s27.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
for P in ${ORDER:-1 0}; do
  MCX_PREPARE_RESTORE=$P MODELS=134m SOURCES=ours KILL=1 RESUME_COLD=0 RESUME_WARM=1 \
    OUT=/tmp/run_p$P WORK=/tmp/rcw_p$P timeout ${BUDGET:-270} bash scripts/gpu_real_client.sh \
    > "$OUT/${CARD}_134m_prepare_$P.txt" 2>&1
  collect_run /tmp/run_p$P "${CARD}_134m_prepare_$P"
  rm -rf /tmp/rcw_p$P
  for f in /tmp/run_p$P/logs/*.log; do
    echo "P=$P $(basename "$f" .log): $(grep -h 'model-and-optimizer-setup\|load-checkpoint' "$f" \
      | awk '{print $1, $3}' | tr '\n' ' ')$(grep -ho 'before the model build.*' "$f")"
  done
done
