#!/usr/bin/env bash
# One call on one GPU (carry .whl): 8 ranks x 2 GiB on the one device, the warm load with 2
# reading threads a rank (the rank's cores on a 16-core host, the default) and with 4 (what the
# host's own read-and-copy loop was fastest with in the thirty-seventh session's run), verifying
# and not, two repeats each after the process's first load (timed apart), in one benchmark run
# (bench_load's --load-threads takes both; floors measured once in it).
# Results under $OUT: <card>_8ranks_2gib_load_threads.json/.log.
# From the repository root:  OUT=$OUT bash docs/node/steps/threads_ab_s37.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NPROC=${NPROC:-8}; GIB=${GIB:-2}
NAME=${CARD}_${NPROC}ranks_${GIB}gib_load_threads
timeout -k 10 ${STEP_TIMEOUT:-300} python3 -m torch.distributed.run --standalone \
  --nproc-per-node "$NPROC" benchmarks/bench_load.py --gib "$GIB" --repeats 2 --caches warm \
  --sources ours ours_no_verify --load-threads ${THREADS:-2 4} \
  --out /tmp/node_load_threads --json "$OUT/$NAME.json" > "$OUT/$NAME.log" 2>&1
echo "rc=$?"; grep "bench_load\]\|Error" "$OUT/$NAME.log" | tail -12
rm -rf /tmp/node_load_threads
