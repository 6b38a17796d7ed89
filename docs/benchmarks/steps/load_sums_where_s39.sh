#!/usr/bin/env bash
# One call on one GPU (carry .whl): where a verifying warm load of 8 GiB at one rank sums its
# bytes, the device (the Triton CRC, the default) or the host (MCX_DEVICE_CRC_TRITON=0: summing
# threads beside the reading ones), each in a run of its own (the switch is read per process),
# warm only, verifying and not, REPEATS each, every load checked bit-exact; the order of the two
# runs alternates with ORDER. Results under $OUT: <card>_load8_sums_{device,host}.json/.log.
# From the repository root:
#   OUT=$OUT bash docs/benchmarks/steps/load_sums_where_s39.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
for where in ${ORDER:-device host}; do
  v=1; [ $where = host ] && v=0
  log="$OUT/${CARD}_load8_sums_$where.log"
  MCX_DEVICE_CRC_TRITON=$v timeout -k 5 ${STEP_TIMEOUT:-170} python3 -m torch.distributed.run \
    --standalone --nproc-per-node 1 benchmarks/bench_load.py --gib 8 --repeats ${REPEATS:-3} \
    --caches warm --sources ours ours_no_verify --no-first-load --out /tmp/load8_$where \
    --json "$OUT/${CARD}_load8_sums_$where.json" > "$log" 2>&1
  echo "$where rc=$?"; grep "bench_load\] ours\|Error" "$log" | cut -c1-150
  rm -rf /tmp/load8_$where
done
