# thirtieth session, one H200 (carry .whl): the managed copy-ahead block's GPU test (fixed after
# call 3) and the memory tier's prepared restart with --ckpt-restore-prefetch on CUDA, then the
# GPU test once with free_later made a no-op (its last part must fail).
source docs/megatron_lm/steps/_prologue.sh; export PYTHONPATH=$PWD:$PWD/.site
OUT=$OUT/t bash scripts/gpu_tests.sh --timeout 200 -k "gives_way or (prepared_while_the_model and True)" \
  > /dev/null 2>&1; tail -4 $OUT/t/tests.log
cp megatron_ckpt_ext/load/managed_block.py /tmp/mb.py
sed -i 's/    holder.clear()  # the last view: cudaFree here/    pass/' megatron_ckpt_ext/load/managed_block.py
MCX_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/multirank/test_cuda_load.py -k gives_way 2>&1 | grep -E "passed|failed|^E " \
  | tail -4 | tee $OUT/mutation.txt
cp /tmp/mb.py megatron_ckpt_ext/load/managed_block.py
