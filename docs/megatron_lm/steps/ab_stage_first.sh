#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm .ab), in one call: the real client (134M, saves every 50)
# with a steady save's staging after its directory opens (.ab/before/{checkpointer,steps}.py =
# megatron_ckpt_ext/checkpointer.py and save/steps.py before 1126k's stage-first commit) and
# before it (.ab/after/ = the same files after); stock beside the second (SOURCES). Each run's
# save reports (blocking, phases) printed from its logs.
# Results: docs/megatron_lm/real_client/h100_134m_1126k_stage_first_{before,after}.json, _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
source docs/megatron_lm/steps/_ab_run.sh
for v in before after; do
  cp .ab/$v/checkpointer.py megatron_ckpt_ext/checkpointer.py
  cp .ab/$v/steps.py megatron_ckpt_ext/save/steps.py
  case $v in before) SRC=ours ;; after) SRC=${SOURCES:-ours stock} ;; esac
  ab_run $v "$SRC" 300 h100_134m_1126k_stage_first
done
cp .ab/after/checkpointer.py megatron_ckpt_ext/checkpointer.py
cp .ab/after/steps.py megatron_ckpt_ext/save/steps.py
