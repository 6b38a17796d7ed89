#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm .ab), in one call: the real client (134M, ours only, saves
# every 50) with the stage's device-to-host copies issued one `torch.cuda.stream` context per
# tensor (.ab/copies_before.py = megatron_ckpt_ext/staging/copies.py before 1126k) and once per
# device through torch._foreach_copy_ (.ab/copies_after.py = the same file after); each run's
# save reports (blocking, phases) printed from its logs. The CUDA staging tests run first.
# Results: docs/megatron_lm/real_client/h100_134m_1126k_copies_{before,after}.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
source docs/megatron_lm/steps/_ab_run.sh
for v in before after; do
  cp .ab/copies_$v.py megatron_ckpt_ext/staging/copies.py
  ab_run $v ours 250 h100_134m_1126k_copies
done
cp .ab/copies_after.py megatron_ckpt_ext/staging/copies.py
