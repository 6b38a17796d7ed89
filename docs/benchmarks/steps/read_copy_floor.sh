#!/usr/bin/env bash
# One GPU: what the host gives for reading warm page-cache bytes and copying them to the device
# at once (benchmarks/probe_read_copy_floor.py, 8 GiB in 8 files), then 8 GiB warm loads of this
# tree at 8 and 16 reading threads alternated, each beside the same load without verification.
# From the repository root on the GPU machine:  OUT=$OUT bash docs/benchmarks/steps/read_copy_floor.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source docs/benchmarks/steps/_load_runs.sh
timeout 240 python3 benchmarks/probe_read_copy_floor.py --dir /tmp/rcf --gib "${GIB:-8}" \
  --json "$OUT/read_copy_floor.json" > /tmp/rcf.log 2>&1; echo "probe rc=$?"; tail -20 /tmp/rcf.log
rm -rf /tmp/rcf
load_runs ${ORDER:-new:8 new:16 new:8 new:16}
