#!/usr/bin/env bash
# One GPU: the GPU tests of the load, then 8 GiB warm loads (verifying on the device, and
# without verification), old code (a copy of an earlier commit's package and benchmarks in
# $OLD: each reading thread waited for every copy) and this tree (a copy left in flight while
# the thread reads on) alternated; "new:16" runs this tree with 16 reading threads.
# From the repository root on the GPU machine:
#   OLD=.ab_old OUT=$OUT bash docs/benchmarks/steps/copies_in_flight_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source docs/benchmarks/steps/_load_runs.sh
MCX_TEST_DEVICE=cuda MCX_TEST_WORLD=1 timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/multirank/test_cuda_load.py --junitxml "$OUT/junit_cuda_load.xml" 2>&1 | tail -3
load_runs ${ORDER:-old new old new new:16}
