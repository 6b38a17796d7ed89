#!/usr/bin/env bash
# One GPU: what the host gives for reading warm page-cache bytes and copying them to the device
# at once (benchmarks/probe_read_copy_floor.py, 8 GiB in 8 files), then 8 GiB warm loads of this
# tree at 8 and 16 reading threads alternated, each beside the same load without verification.
# From the repository root on the GPU machine:  OUT=$OUT bash docs/benchmarks/steps/read_copy_floor.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
timeout 240 python3 benchmarks/probe_read_copy_floor.py --dir /tmp/rcf --gib "${GIB:-8}" \
  --json "$OUT/read_copy_floor.json" > /tmp/rcf.log 2>&1; echo "probe rc=$?"; tail -20 /tmp/rcf.log
rm -rf /tmp/rcf
i=0
for t in ${THREADS:-8 16 8 16}; do
  i=$((i + 1))
  timeout -k 10 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/bench_load.py --gib "${GIB:-8}" --repeats "${REPEATS:-2}" --sources ours ours_no_verify \
    --caches warm --load-threads "$t" --out /tmp/bl --json "$OUT/load8_t${t}_$i.json" > "/tmp/load8_t${t}_$i.log" 2>&1
  echo "threads=$t run=$i rc=$?"; grep "bench_load\]" "/tmp/load8_t${t}_$i.log" | cut -c1-200
  rm -rf /tmp/bl
done
