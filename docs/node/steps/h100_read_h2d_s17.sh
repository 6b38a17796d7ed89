#!/usr/bin/env bash
# One GPU (carry .whl), one call: the host's own read-and-copy loop (bench_load.py's
# read_h2d_warm_gbps floor) beside the warm loads, (1) 8 ranks x 2 GiB sharing the GPU, (2) one
# rank x 8 GiB; warm only, ours verifying and not. From the repository root:
#   OUT=$OUT bash docs/node/steps/h100_read_h2d_s17.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
for spec in "8 2" "1 8"; do
  set -- $spec
  timeout -k 10 220 python3 -m torch.distributed.run --standalone --nproc-per-node "$1" \
    benchmarks/bench_load.py --ranks-per-device auto --gib "$2" --repeats 2 --caches warm \
    --sources ours ours_no_verify --out /tmp/rh2d --json "$OUT/load_${1}x${2}.json" \
    > "$OUT/load_${1}x${2}.log" 2>&1
  echo "$1 ranks x $2 GiB rc=$?"; grep "bench_load\]" "$OUT/load_${1}x${2}.log" | cut -c1-120
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['floors'], d['targets'].get('warm_gbps_over_read_h2d'), d['targets']['warm_gbps_over_floor'])" "$OUT/load_${1}x${2}.json"
  rm -rf /tmp/rh2d
done
