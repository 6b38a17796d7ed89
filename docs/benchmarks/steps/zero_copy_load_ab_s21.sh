# One GPU: the CUDA load tests (the zero-copy half among them), then the 8 GiB warm load with the
# zero-copy half (ours, the default) against reads through pinned chunks only (ours_bounce),
# both verifying, and ours without verification, in one run (three repeats, floors in the run).
# Ran at 27ed16c (unregistered per segment) and a625f20 (unregistered at the end); the zero-copy
# half and the ours_bounce source were taken out after (slower: docs/benchmarks/README.md,
# twenty-first session), so rerun it on a checkout of a625f20.
# From the repository root on the GPU machine: OUT=$OUT bash docs/benchmarks/steps/zero_copy_load_ab_s21.sh
set -e
source docs/megatron_lm/steps/_prologue.sh
MCX_TEST_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider tests/functional/multirank/test_cuda_load.py \
  --junitxml="$OUT/junit_cuda_load_s21.xml" 2>&1 | tail -15
python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_load.py --gib 8 --repeats 3 \
  --caches warm --sources ours ours_bounce ours_no_verify --out /tmp/load8_s21 \
  --json "$OUT/${CARD}_load_8gib_zero_copy_s21.json" 2>&1 | grep -v "^W1\|Warning" | tee "$OUT/${CARD}_load_8gib_zero_copy_s21.log" | tail -30
