#!/usr/bin/env bash
# A/B on one GPU (carry .whl), in one call: the 8 GiB load benchmark with the reading threads
# sharing one descriptor per file (MCX_READ_SHARED_FD=1, as before) and with a sequential
# descriptor of its own per stripe (the default, backend/load_reader.py). Each run measures its
# own floors. Results: docs/benchmarks/steps/h200_load_8gib_1126r_fd_{shared,own}.json. The own-
# descriptor reading read no faster and was taken out again: run this at commit 2eb2d6d.
set -uo pipefail
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/.site
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
python3 -m megatron_ckpt_ext doctor 2>&1 | grep -i crc
for v in shared own; do
  if [ $v = shared ]; then export MCX_READ_SHARED_FD=1; else unset MCX_READ_SHARED_FD; fi
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_load.py \
    --gib 8 --repeats 2 --sources ours ours_no_verify --out /tmp/bench_load_$v \
    --json "$OUT/${CARD}_load_8gib_1126r_fd_$v.json" 2>&1 | grep -v -i "warn" | tail -12
  rm -rf /tmp/bench_load_$v
done
