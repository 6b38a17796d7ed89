#!/usr/bin/env bash
# One call on two GPUs, one per rank (kind nvidia-h200-x2; carry .whl .mlm): the 134M recipe with
# tensor parallelism 2, ours and stock, the cold resume from 200 in TP2 and into TP1 DP2, and
# ours' kill -9 of every process after the committed save at 200 with the restart from memory
# (and the warm storage load of a copy):
#   OUT=$OUT LABEL=s23_tp2 BUDGET=560 bash docs/megatron_lm/steps/run_x2_tp2_s23.sh
# Results: $OUT/<card>x2_134m_$LABEL.json and _logs.tgz; what it printed: _printed.txt.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
LABEL=${LABEL:-s23_tp2}
R=/tmp/run_$LABEL W=/tmp/rcw_$LABEL
nvidia-smi --query-gpu=name --format=csv,noheader
NPROC=2 LAYOUT=tp2 PAR_ARGS="--tensor-model-parallel-size 2" RESUME_STEP=200 \
  OTHER_PAR_ARGS="--tensor-model-parallel-size 1 --micro-batch-size 2" OTHER_LAYOUT=dp2 \
  MODELS=134m SOURCES="${SOURCES:-ours stock}" KILL=${KILL:-1} RESUME_COLD=1 RESUME_WARM=0 \
  RUN_TIMEOUT=${RUN_TIMEOUT:-150} OUT=$R WORK=$W timeout ${BUDGET:-560} bash scripts/gpu_real_client.sh 2>&1 \
  | tee "$OUT/${CARD}x2_134m_${LABEL}_printed.txt" | grep '"save"\|"load"\|identical\|differ\|rc=\|killed\|Error\|error\|No space'
echo "driver rc=${PIPESTATUS[0]}"
collect_run $R "${CARD}x2_134m_$LABEL"
rm -rf "$W"
