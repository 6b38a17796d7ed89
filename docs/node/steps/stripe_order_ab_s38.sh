#!/usr/bin/env bash
# One call on one GPU (carry .whl .ab_old): an A/B of two package versions on the load, one rank,
# bench_load's GPT at 2 GiB (396 items, shaped like Megatron-LM's 134M state), warm, 8 reading
# threads, verifying and not, REPEATS each; every load checked bit-exact. "new" is this tree;
# "old" runs .ab_old's own copy of the benchmark, which puts .ab_old first on sys.path (the
# benchmark inserts its repository root; a PYTHONPATH entry would lose to it, as in this
# script's first run: docs/node/steps/stripe_order_s38/). Made for the thirty-eighth session's
# stripe_order.patch (the copy stream ordered once a stripe): apply it to the tree, and
#   rm -rf .ab_old; mkdir .ab_old
#   git archive HEAD megatron_ckpt_ext benchmarks | tar -x -C .ab_old
# Results under $OUT: <card>_stripe_order_{new,old}.json/.log; each log's first line names the
# package it imported. From the repository root:
#   OUT=$OUT bash docs/node/steps/stripe_order_ab_s38.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
for v in new old; do
  root=$PWD; [ $v = old ] && root=$PWD/.ab_old
  log="$OUT/${CARD}_stripe_order_$v.log"
  (cd "$root" && python3 -c "import sys; sys.path.insert(0, '.'); import megatron_ckpt_ext as m
print('package:', m.__file__)") > "$log" 2>&1
  (cd "$root" && timeout -k 5 ${STEP_TIMEOUT:-120} python3 -m torch.distributed.run --standalone \
    --nproc-per-node 1 benchmarks/bench_load.py --gib 2 --repeats ${REPEATS:-3} --caches warm \
    --sources ours ours_no_verify --load-threads 8 --no-first-load --out /tmp/stripe_$v \
    --json "$OUT/${CARD}_stripe_order_$v.json") >> "$log" 2>&1
  echo "$v rc=$?"; grep "package:\|bench_load\] ours\|Error" "$log" | cut -c1-120
  rm -rf /tmp/stripe_$v
done
