#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): the real client at the eighteenth session's start (code
# after the one-rank load fix, 40e1e23), ours vs stock in one run, every row: train (first,
# steady, end of training), cold and warm resume, and ours killed after a committed save and
# restarted from memory (KILL=1) with the warm storage load of a copy. Results:
# docs/megatron_lm/real_client/<card>_134m_s18.json (+ _logs.tgz). From the repository root:
#   OUT=$OUT bash docs/megatron_lm/steps/recheck_s18.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
MODELS=${MODELS:-134m} KILL=1 RESUME_COLD=1 RESUME_WARM=1 OUT=/tmp/run_s18 WORK=/tmp/rcw_s18 \
  timeout ${BUDGET:-560} bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc=\|Error\|error'
cp /tmp/run_s18/real_client.json "$OUT/${CARD}_${MODELS}_s18.json"
cp /tmp/run_s18/logs.tgz "$OUT/${CARD}_${MODELS}_s18_logs.tgz"
mkdir -p /tmp/x_s18 && tar xzf /tmp/run_s18/logs.tgz -C /tmp/x_s18
source docs/megatron_lm/steps/_ab_run.sh
print_reports /tmp/x_s18
