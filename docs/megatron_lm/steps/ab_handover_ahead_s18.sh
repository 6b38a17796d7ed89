#!/usr/bin/env bash
# A/B on one GPU (carry .whl .mlm .ab_old), in one call: the real client (134M, saves every 50,
# train then the cold resume; ours only) with the first save's hand-over pickled in that save
# (old: .ab_old/megatron_ckpt_ext = the package at 84166d5) and made ahead by prepare() (new:
# this tree, 4206dd9), alternated old new old new. Each run's save reports (blocking, phases)
# printed from its logs. Results: docs/megatron_lm/real_client/<card>_134m_s18_handover_{old,new}_N.json
# (+ _logs.tgz). RUN_LIMIT bounds each run with its summary: the s18 call ran it at 125 s and
# lost runs 1-3 (train + cold resume + the summary take 110-120 s there). ORDER may name "stock"
# (stock Megatron, same flags, in the same call); TAG names the results (default s18). From the
# repository root:
#   OUT=$OUT bash docs/megatron_lm/steps/ab_handover_ahead_s18.sh
#   OUT=$OUT ORDER="old new stock" TAG=s19 bash docs/megatron_lm/steps/ab_handover_ahead_s18.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
R=${OUT:?}
source docs/megatron_lm/steps/_ab_run.sh
mv megatron_ckpt_ext .ab_new_pkg
n=0
for v in ${ORDER:-old new old new}; do
  n=$((n + 1))
  rm -rf megatron_ckpt_ext
  if [ "$v" = old ]; then cp -r .ab_old/megatron_ckpt_ext .; else cp -r .ab_new_pkg megatron_ckpt_ext; fi
  src=ours; [ "$v" = stock ] && src=stock  # stock Megatron, same flags (no package of ours)
  ab_run "${v}_$n" $src ${RUN_LIMIT:-180} "${CARD}_134m_${TAG:-s18}_handover"
done
rm -rf megatron_ckpt_ext && mv .ab_new_pkg megatron_ckpt_ext
