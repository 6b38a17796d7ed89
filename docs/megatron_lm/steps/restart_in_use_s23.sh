#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm), after the "snapshot in use" check (c18df94): the real
# client's kill run at 134M (our uninterrupted run, kill -9 of every process after the committed
# save at 200, the relaunch, the warm storage load of a copy), so the restart shows that a job
# whose predecessor was killed still restores from memory; then the memory-tier tests on the GPU
# (one rank):
#   OUT=$OUT bash docs/megatron_lm/steps/restart_in_use_s23.sh        (TESTS_ONLY=1: the tests alone)
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
R=/tmp/run_s23 W=/tmp/rcw_s23
if [ "${TESTS_ONLY:-0}" != 1 ]; then
MODELS=134m SOURCES=ours KILL=1 RESUME_COLD=0 RESUME_WARM=0 OUT=$R WORK=$W \
  timeout ${BUDGET:-330} bash scripts/gpu_real_client.sh 2>&1 | tee "$OUT/${CARD}_134m_s23_printed.txt" \
  | grep '"save"\|"load"\|identical\|rc=\|killed\|Error'
[ -f $R/real_client.json ] && cp $R/real_client.json "$OUT/${CARD}_134m_s23.json" && cp $R/logs.tgz "$OUT/${CARD}_134m_s23_logs.tgz"
rm -rf "$W"
fi
MCX_TEST_DEVICE=cuda MCX_TEST_WORLD=1 timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider \
  tests/functional/multirank/test_memory_tier.py --junitxml "$OUT/junit_memory_tier_s23.xml" 2>&1 | tail -5
