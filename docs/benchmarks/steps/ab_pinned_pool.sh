#!/usr/bin/env bash
# A/B on one GPU, in one call (carry .whl and .abold: `git archive 870d500 megatron_ckpt_ext
# benchmarks | tar -x -C .abold`): the first load of a fresh process, cold then warm, with the
# load's host chunks pinned all before the first read (old, 870d500) and made as the reading
# threads ask (new, 758bcc7). 1.75 GiB per rank (the 134M recipe's 1.885 GB), three processes per
# variant, alternating. Results: docs/benchmarks/steps/<card>_pinned_pool_{old,new}_<i>.json.
set -uo pipefail
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
for i in 1 2 3; do
  for v in old new; do
    root=$PWD; [ $v = old ] && root=$PWD/.abold
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 "$root/benchmarks/bench_load.py" \
      --gib 1.75 --repeats 1 --sources ours --out /tmp/bench_pool_$v \
      --json "$OUT/${CARD}_pinned_pool_${v}_$i.json" 2>&1 | grep -v -i "warn" | grep -i "ours\|floor" | tail -4
    rm -rf /tmp/bench_pool_$v
  done
done
