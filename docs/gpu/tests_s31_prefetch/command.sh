# thirty-first session, one H200 (carry .whl): the copy-ahead block's GPU tests at the code of
# the default copy ahead (torch's own block where it fits beside the sealing run's peak): the
# managed block's test (still the block of --ckpt-restore-prefetch on where torch's does not
# fit) and the memory tier's prepared restart with the copy ahead on CUDA (asserts torch's block).
source docs/megatron_lm/steps/_prologue.sh; export PYTHONPATH=$PWD:$PWD/.site
OUT=$OUT/t bash scripts/gpu_tests.sh --timeout 200 -k "gives_way or (prepared_while_the_model and True)" \
  > /dev/null 2>&1; tail -4 $OUT/t/tests.log
