#!/usr/bin/env bash
# One GPU: what the device CRC costs a process's host memory (probe run twice: Triton's cache
# cold, then warm), then 8 GiB warm loads with the sums on the device at 8 and at 16 reading
# threads, alternated (8, 16, 8, 16), each beside the same load without verification.
# From the repository root on the GPU machine:  OUT=$OUT bash docs/benchmarks/steps/threads_device_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
for i in 1 2; do python3 benchmarks/probe_device_crc_memory.py > "$OUT/device_crc_memory_$i.json"; done
cat "$OUT"/device_crc_memory_*.json
i=0
for t in ${THREADS:-8 16 8 16}; do
  i=$((i + 1))
  timeout -k 10 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/bench_load.py --gib "${GIB:-8}" --repeats "${REPEATS:-2}" --sources ours ours_no_verify \
    --caches warm --load-threads "$t" --out /tmp/bl --json "$OUT/load8_t${t}_$i.json" > "$OUT/load8_t${t}_$i.log" 2>&1
  echo "threads=$t run=$i rc=$?"; grep "bench_load\]" "$OUT/load8_t${t}_$i.log" | cut -c1-200
  rm -rf /tmp/bl
done
