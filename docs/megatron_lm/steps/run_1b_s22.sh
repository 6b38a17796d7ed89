#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): the ~1B recipe of run_1b_stock.sh (saves every 200, 600
# iterations, a cold resume to 650) for ONE source at a time, so that one source's 12.2 GB
# checkpoints are on the 64 GB disk at once (H200):
#   OUT=$OUT SOURCES=ours  KILL=1 LABEL=s22_ours  BUDGET=530 bash docs/megatron_lm/steps/run_1b_s22.sh
#   OUT=$OUT SOURCES=stock KILL=0 LABEL=s22_stock BUDGET=450 bash docs/megatron_lm/steps/run_1b_s22.sh
# KILL=1 adds ours' kill -9 after the committed save at 400 and the restart from memory (with the
# warm storage load of a copy). RESUME_WARM=0 unless set. Results: $OUT/<card>_1b_$LABEL.json and
# _logs.tgz; what it printed: _printed.txt; free disk every 5 s: _df.txt. If the budget stops the
# run first, the logs so far: _partial_logs.tgz. The work folder is removed at the end.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
LABEL=${LABEL:-s22_${SOURCES:-ours}}
R=/tmp/run_$LABEL W=/tmp/rcw_$LABEL
df -h /tmp /dev/shm
( while :; do echo "$(date +%T) $(df -B1M --output=avail /tmp | tail -1) MB free /tmp"; sleep 5; done ) \
  > "$OUT/${CARD}_1b_${LABEL}_df.txt" 2>&1 &
DF=$!
MODELS=1b SOURCES=${SOURCES:-ours} KILL=${KILL:-1} RESUME_COLD=1 RESUME_WARM=${RESUME_WARM:-0} \
  SAVE_EVERY_1B=${SAVE_EVERY_1B:-200} ITERS_1B=${ITERS_1B:-600} RESUME_ITERS_1B=${RESUME_ITERS_1B:-650} \
  RUN_TIMEOUT=${RUN_TIMEOUT:-240} OUT=$R WORK=$W timeout ${BUDGET:-530} bash scripts/gpu_real_client.sh 2>&1 \
  | tee "$OUT/${CARD}_1b_${LABEL}_printed.txt" | grep '"save"\|"load"\|identical\|rc=\|killed\|Error\|error\|No space'
echo "driver rc=${PIPESTATUS[0]}"
kill $DF 2>/dev/null
collect_run $R "${CARD}_1b_$LABEL"
df -h /tmp /dev/shm; rm -rf "$W"
