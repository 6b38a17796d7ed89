# One H200: zero-copy and bounce reads at once over one 8 GiB file set (each path takes 64 MiB
# chunks at its own rate from its end), against plain bounce runs with as many threads.
# From the repository root on the GPU machine: OUT=$OUT bash docs/benchmarks/steps/hybrid_read_h200_s21.sh
set -e
source docs/megatron_lm/steps/_prologue.sh
python3 benchmarks/zero_copy_probe.py --dir /tmp/zc --gib 8 --files 4 --repeats 2 \
  --hybrid 4,8 4,12 2,14 8,8 6,10 --json "$OUT/h200_hybrid_read_s21.json" 2>&1 | tee "$OUT/h200_hybrid_read_s21.log"
