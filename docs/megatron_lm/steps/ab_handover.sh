#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm), in one call: the real client (134M, saves every 50) with the
# persistent writer's request pickled in full at every save (MCX_RESEND_EACH_SAVE=1, as before
# save/handover.py) and with the write items and staged tensors kept in the writer (the default);
# stock in the second run's call too (SOURCES). Each run's save reports printed from its logs:
# blocking, the phases and copy_queue_wait_s.
# Results: docs/megatron_lm/real_client/h100_134m_1126k_handover_{resend,keep}.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
source docs/megatron_lm/steps/_ab_run.sh
for v in resend keep; do
  case $v in resend) export MCX_RESEND_EACH_SAVE=1; SRC=ours ;;
             keep) unset MCX_RESEND_EACH_SAVE; SRC=${SOURCES:-ours stock} ;; esac
  ab_run $v "$SRC" 280 h100_134m_1126k_handover
done
