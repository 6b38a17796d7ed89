#!/usr/bin/env bash
# A/B of d0fda56 (the checkpoint's own collectives on a gloo group), run on one H100 with
#   carry [.whl, .mlm, .ab]; .ab/collectives_before.py = megatron_ckpt_ext/collectives.py at 3bc7822,
#   .ab/collectives_after.py = the same file at d0fda56. Results: real_client/h100_134m_1126_control_ab.tgz
# A/B of the control group (collectives on gloo vs on the NCCL world), 134M real client, ours only.
# VARIANTS="before after after_sync" (after_sync: the after code with MCX_SYNC_POINTS)
set -uo pipefail
cd "$(dirname "$0")/.."
R=${OUT:?}; MODEL=${MODEL:-134m}
for v in ${VARIANTS:-before after after_sync}; do
  case $v in before) cp .ab/collectives_before.py megatron_ckpt_ext/collectives.py ;;
             *) cp .ab/collectives_after.py megatron_ckpt_ext/collectives.py ;; esac
  mkdir -p "$R/$v"
  if [ "$v" = after_sync ]; then export MCX_SYNC_POINTS=$R/$v/logs/sync; else unset MCX_SYNC_POINTS; fi
  echo "== $v $(date +%T)"
  OUT=$R/$v SOURCES=${SOURCES:-ours} KILL=0 RESUME_WARM=0 MODELS=$MODEL SAVE_EVERY_134M=${SAVE_EVERY_134M:-50} \
    bash scripts/gpu_real_client.sh 2>&1 | tail -25
done
cp .ab/collectives_after.py megatron_ckpt_ext/collectives.py
cd "$R" && tar czf ab.tgz */real_client.json */logs.tgz && rm -rf before after after_sync
