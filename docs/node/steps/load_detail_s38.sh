#!/usr/bin/env bash
# One call on one GPU (carry .whl): where a warm load's time goes, rank by rank (the load
# report's rank_phases and verify_detail, kept by bench_load for every rank), and the one-rank
# reading threads A/B with more repeats. First 8 ranks x 2 GiB on the one device (default
# threads, 3 repeats), then one rank x 8 GiB warm (--load-threads 8 16, 4 repeats each).
# Results under $OUT: <card>_8ranks_2gib_load_detail.json/.log and
# <card>_1rank_8gib_load_ab.json/.log.
# From the repository root:  OUT=$OUT bash docs/node/steps/load_detail_s38.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NAME=${CARD}_8ranks_2gib_load_detail
timeout -k 10 ${NODE_TIMEOUT:-220} python3 -m torch.distributed.run --standalone \
  --nproc-per-node 8 benchmarks/bench_load.py --gib 2 --repeats 3 --caches warm \
  --sources ours ours_no_verify --out /tmp/node_load_detail --json "$OUT/$NAME.json" \
  > "$OUT/$NAME.log" 2>&1
echo "rc=$?"; grep "bench_load\]\|Error" "$OUT/$NAME.log" | tail -14
rm -rf /tmp/node_load_detail
NAME=${CARD}_1rank_8gib_load_ab
timeout -k 10 ${ONE_TIMEOUT:-260} python3 -m torch.distributed.run --standalone \
  --nproc-per-node 1 benchmarks/bench_load.py --gib 8 --repeats 4 --caches warm \
  --sources ours ours_no_verify --load-threads 8 16 \
  --out /tmp/one_load_ab --json "$OUT/$NAME.json" > "$OUT/$NAME.log" 2>&1
echo "rc=$?"; grep "bench_load\]\|Error" "$OUT/$NAME.log" | tail -18
rm -rf /tmp/one_load_ab
