#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): the ~1B recipe, ours vs stock in the same run, saves
# every 200 (each 12.2 GB write ends before the next save on these disks), 600 iterations, a cold
# resume to 650 (its save at 650 is the first after the resume and the end of training).
# KILL=0, RESUME_WARM=0. Results: docs/megatron_lm/real_client/<card>_1b_$LABEL.json (+ _logs.tgz).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
LABEL=${LABEL:-1128c}
MODELS=1b SOURCES="ours stock" KILL=0 RESUME_WARM=0 SAVE_EVERY_1B=200 ITERS_1B=600 RESUME_ITERS_1B=650 \
  RUN_TIMEOUT=240 OUT=/tmp/run_$LABEL WORK=/tmp/rcw_$LABEL timeout 570 bash scripts/gpu_real_client.sh 2>&1 \
  | grep '"save"\|"load"\|identical\|rc='
cp /tmp/run_$LABEL/real_client.json "$OUT/${CARD}_1b_$LABEL.json"
cp /tmp/run_$LABEL/logs.tgz "$OUT/${CARD}_1b_${LABEL}_logs.tgz"
