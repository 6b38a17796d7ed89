#!/usr/bin/env bash
# NPROC ranks (one GPU each where the host has them): is a process's first load slower, and why?
# 1. the load benchmark with its first load unverified, 2. with its first load verifying (each
# repeated: the second load of a process is the steady one), 3. the chunk pinning alone, every
# rank at once. From the repository root:  OUT=$OUT NPROC=4 bash docs/node/steps/first_load.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NPROC=${NPROC:-4}; GIB=${GIB:-2}
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
for s in ours_no_verify ours; do
  timeout -k 10 200 "${TR[@]}" benchmarks/bench_load.py --ranks-per-device auto --gib "$GIB" \
    --repeats 2 --sources $s --caches warm --out /tmp/fl --json "$OUT/first_$s.json" > "$OUT/first_$s.log" 2>&1
  echo "$s rc=$?"; grep "bench_load\]" "$OUT/first_$s.log" | cut -c1-160; rm -rf /tmp/fl
done
timeout 120 "${TR[@]}" benchmarks/probe_pinning.py --count 24 --chunk-mib 32 2>&1 | grep '^{'
timeout 120 python3 benchmarks/probe_pinning.py --count 24 --chunk-mib 32 2>&1 | grep '^{'
