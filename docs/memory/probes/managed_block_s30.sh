set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
for a in "" "--no-advise"; do
  timeout 150 python benchmarks/probe_managed_block.py --block-gib 16 --fill-frac 0.9 $a --json $OUT/managed${a:+_noadvise}.json 2>&1 | tail -40
done
