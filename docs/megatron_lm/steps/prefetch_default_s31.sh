#!/usr/bin/env bash
# One call on one H200 (carry .whl .mlm): the copy ahead as the default (--ckpt-restore-prefetch
# auto, thirty-first session).
# 1. the ~1B restart repeated (restart_repeat_s28.sh): the default (early_default: copied ahead
#    into torch's block) against no copy ahead (early_host: --ckpt-restore-prefetch off), storage;
# 2. the 134M kill run of the real client with our defaults (gpu_real_client.sh: train, kill -9
#    after the committed save at 200, relaunch; losses against the uninterrupted run; the first
#    save after the restart; the warm storage load of a copy).
#   OUT=$OUT bash docs/megatron_lm/steps/prefetch_default_s31.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
OUT=$OUT MODEL=1b REPEATS=1 MODES="early_default early_host" \
  bash docs/megatron_lm/steps/restart_repeat_s28.sh
MODELS=134m SOURCES=ours KILL=1 RESUME_COLD=0 RESUME_WARM=0 OUT=/tmp/kill_s31 \
  timeout ${KILL_TIMEOUT:-280} bash scripts/gpu_real_client.sh 2>&1 | tail -25
collect_run /tmp/kill_s31 h200_134m_kill_s31
