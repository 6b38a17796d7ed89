#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm), in one call: the real client (134M, ours only, saves every
# 50) with Python's cyclic collector running inside save() (MCX_GC_IN_SAVE=1, as before) and
# paused while save() blocks (the default). Each run's save reports printed from its logs:
# blocking, the phases and the collector's pauses inside the save (gc_pause_s, collections).
# Results: docs/megatron_lm/real_client/h100_134m_1126n_gc_{in_save,paused}.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
source docs/megatron_lm/steps/_ab_run.sh
for v in in_save paused; do
  case $v in in_save) export MCX_GC_IN_SAVE=1 ;; paused) unset MCX_GC_IN_SAVE ;; esac
  ab_run $v ours 250 h100_134m_1126n_gc
done
