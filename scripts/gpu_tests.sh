#!/usr/bin/env bash
# GPU evidence for the checkpointer and staging (issues 4, 5, 20 and 32): the same functional tests as
# CI, with CUDA tensors, NCCL, one rank per GPU, on the newest stack (see ../shared/GPU.md: install
# .whl first), plus the device-side ordering tests that only run on CUDA
# (tests/functional/multirank/test_cuda_ordering.py: the copy stream waits for the producing
# kernels, the optimizer step waits for overlapped copies, each with its contrast run). Writes a
# junit XML, the log and versions under $OUT (default ./gpu_out). Extra arguments go to pytest
# (e.g. `-k ordering`); exits with pytest's status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export MCX_TEST_DEVICE=cuda MCX_TEST_WORLD=${MCX_TEST_WORLD:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
python3 -m megatron_ckpt_ext doctor --json > "$OUT/doctor.json"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -m pytest -v -s -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" \
  tests/functional/multirank/test_checkpointer.py tests/functional/multirank/test_cuda_ordering.py \
  tests/functional/multirank/test_trust.py tests/functional/multirank/test_cuda_load.py \
  tests/functional/multirank/test_memory_tier.py \
  tests/functional/e2e/test_train_loop.py "$@" 2>&1 | tee "$OUT/tests.log"
