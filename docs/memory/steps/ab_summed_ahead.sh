#!/usr/bin/env bash
# A/B run on one H100 (carry .whl .mlm .ab): .ab/before = megatron_ckpt_ext/ and benchmarks/ at the
#   commit before the snapshot was summed ahead (git archive HEAD~ megatron_ckpt_ext benchmarks);
#   "after" = the tree itself. Both: bench_memory_restore 8 GiB, prepare_restore() right before the
#   load (so the load waits for what was prepared: no model is built in between here).
#   Results: docs/memory/steps/h100_ab_summed_ahead.tgz, docs/notes/memory.md
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
for v in ${VARIANTS:-before after before after}; do
  dir=$PWD; [ "$v" = before ] && dir=$PWD/.ab/before
  echo "== $v $(date +%T)"
  (cd "$dir" && timeout 280 python3 benchmarks/bench_memory_restore.py --gib 8 --saves 2 --repeats 2 \
    --cases ${CASES:-ours-memory ours-storage-warm} --out /tmp/mr --json "$R/$v-$RANDOM.json" 2>&1 \
    | grep "^\[restore\]" | cut -c1-600)
done
cd "$R" && tar czf ab_summed_ahead.tgz *.json && rm -f *.json
