#!/usr/bin/env bash
# A/B in one call, 8 ranks on one GPU, GIB GiB a rank, warm verifying loads: the check's share
# with the other ranks' summed files left out (the tree's verify.py) against the one before
# a26df7e (OLD: a copy of that verify.py, e.g. `git show a26df7e~1:megatron_ckpt_ext/load/verify.py`).
#   OUT=$OUT OLD=ab_old_verify.py bash docs/node/steps/settle_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NPROC=${NPROC:-8}; GIB=${GIB:-2}; REPEATS=${REPEATS:-2}
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
cp megatron_ckpt_ext/load/verify.py /tmp/verify_new.py
for which in ${ORDER:-new old}; do
  if [[ $which == old ]]; then cp "$OLD" megatron_ckpt_ext/load/verify.py; else cp /tmp/verify_new.py megatron_ckpt_ext/load/verify.py; fi
  timeout -k 10 ${STEP_TIMEOUT:-140} "${TR[@]}" benchmarks/bench_load.py --ranks-per-device auto \
    --gib "$GIB" --repeats "$REPEATS" --sources ours ours_no_verify --caches warm \
    --out /tmp/node_load --json "$OUT/node_load_$which.json" > "$OUT/node_load_$which.log" 2>&1
  echo "$which rc=$?"; grep "bench_load\]" "$OUT/node_load_$which.log" | cut -c1-150
  rm -rf /tmp/node_load
done
cp /tmp/verify_new.py megatron_ckpt_ext/load/verify.py
