# One H200: the zero-copy read (page-cache pages registered in place and copied by the device)
# against the bounce path (pread into pinned chunks), 8 GiB in 4 files, 8 and 16 threads, 64 MiB.
# Run from the repository root on the GPU machine: OUT=$OUT bash docs/benchmarks/steps/zero_copy_h200_s21.sh
set -e
source docs/megatron_lm/steps/_prologue.sh
nproc; free -g | head -2
python3 benchmarks/zero_copy_probe.py --dir /tmp/zc --gib 8 --files 4 --threads 4 8 16 \
  --chunk-mib 64 --repeats 2 --json "$OUT/h200_zero_copy_s21.json" 2>&1 | tee "$OUT/h200_zero_copy_s21.log"
