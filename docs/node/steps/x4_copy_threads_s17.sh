#!/usr/bin/env bash
# A multi-GPU host, 8 ranks (2 a GPU on four), one call (carry .whl): (1) the host's layout (NUMA,
# GPU topology, /dev/shm, THP for shared memory); (2) benchmarks/probe_d2h_targets.py: the state's
# bytes copied device-to-host into the floor's 1 GiB, a whole pinned buffer, registered /dev/shm
# segments a tensor (the staging's memory), every rank at once, rounds alternated; (3) the 8 GiB
# warm load, ours verifying and not, with 8 and with 16 reading threads a rank alternated in one
# run (--load-threads 8 16; no cold floor). From the repository root:
#   OUT=$OUT GIB=8 bash docs/node/steps/x4_copy_threads_s17.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NPROC=${NPROC:-8}; GIB=${GIB:-8}
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
{ nvidia-smi topo -m; lscpu | grep -i 'numa\|model name\|^cpu(s)'; df -h /dev/shm;
  cat /sys/kernel/mm/transparent_hugepage/shmem_enabled; free -g; } > "$OUT/host.txt" 2>&1
timeout -k 10 180 "${TR[@]}" benchmarks/probe_d2h_targets.py --ranks-per-device auto \
  --gib "$GIB" --rounds 3 --json "$OUT/d2h_targets.json" > "$OUT/d2h_targets.log" 2>&1
echo "probe rc=$?"; grep '^{' "$OUT/d2h_targets.log" | cut -c1-900
rm -f /dev/shm/mcx_probe_*
timeout -k 10 330 "${TR[@]}" benchmarks/bench_load.py --ranks-per-device auto --gib "$GIB" \
  --repeats 2 --caches warm --sources ours ours_no_verify --load-threads 8 16 \
  --out /tmp/x4lt --json "$OUT/load_threads.json" > "$OUT/load_threads.log" 2>&1
echo "load rc=$?"; grep "bench_load\]" "$OUT/load_threads.log" | cut -c1-140
rm -rf /tmp/x4lt
