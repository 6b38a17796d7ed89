#!/usr/bin/env bash
# One call on one GPU (carry .whl): the loads at the current code, reading threads A/B'd in one
# benchmark run each. First 8 ranks x 2 GiB on the one device (--load-threads 2 4: the default
# at 16 cores, and what the host's own read-and-copy loop was fastest with in the thirty-seventh
# session), warm; then one rank x 8 GiB (--load-threads 8 16: the default at one rank, and the
# read floor's count), warm and cold. Verifying and not, two repeats each after the process's
# first load (timed apart). Results under $OUT: <card>_8ranks_2gib_load_threads.json/.log and
# <card>_1rank_8gib_load_threads.json/.log.
# From the repository root:  OUT=$OUT bash docs/node/steps/load_ab_s38.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
OUT=$OUT STEP_TIMEOUT=${NODE_TIMEOUT:-260} bash docs/node/steps/threads_ab_s37.sh
NAME=${CARD}_1rank_8gib_load_threads
timeout -k 10 ${ONE_TIMEOUT:-260} python3 -m torch.distributed.run --standalone \
  --nproc-per-node 1 benchmarks/bench_load.py --gib 8 --repeats 2 --caches warm cold \
  --sources ours ours_no_verify --load-threads ${ONE_THREADS:-8 16} \
  --out /tmp/one_load_threads --json "$OUT/$NAME.json" > "$OUT/$NAME.log" 2>&1
echo "rc=$?"; grep "bench_load\]\|Error" "$OUT/$NAME.log" | tail -16
rm -rf /tmp/one_load_threads
