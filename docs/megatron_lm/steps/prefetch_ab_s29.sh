#!/usr/bin/env bash
# One call on one H200 (carry .whl .mlm): is --ckpt-restore-prefetch worth its default now that
# the restore is prepared in Megatron's initialisation? The real client's kill run at 134M
# (scripts/gpu_real_client.sh, ours only: kill -9 of every process after the commit of 200,
# the relaunch of the same command trained to 350, a warm storage load of a copy), without and
# with the flag; then one round of the 1B restart (restart_repeat_s28.sh) with and without it.
# Every result comes back as a few files (the call returns a limited count):
#   $OUT/h200_134m_s29_{none,prefetch}.json + _logs.tgz, $OUT/restart_repeat_1b.jsonl + _logs.tgz
#   OUT=$OUT bash docs/megatron_lm/steps/prefetch_ab_s29.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
for P in none prefetch; do
  A=""; [ $P = prefetch ] && A="--ckpt-restore-prefetch"
  WORK=/tmp/rc_$P OUT=/tmp/out_$P MODELS=134m SOURCES=none KILL=1 OURS_ARGS="$A" \
    timeout 180 bash scripts/gpu_real_client.sh > /tmp/out_$P.txt 2>&1
  echo "== $P rc $?"; tail -8 /tmp/out_$P.txt
  [ -f /tmp/out_$P/logs.tgz ] || tar -czf /tmp/out_$P/logs.tgz -C /tmp/out_$P/logs . 2>/dev/null
  collect_run /tmp/out_$P h200_134m_s29_$P
done
OUT=$OUT MODEL=1b REPEATS=1 MODES="early_host early_prefetch" timeout 200 \
  bash docs/megatron_lm/steps/restart_repeat_s28.sh 2>&1 | tail -6
