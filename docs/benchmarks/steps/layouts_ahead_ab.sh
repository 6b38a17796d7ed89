#!/usr/bin/env bash
# One GPU: 8 GiB warm loads, old code (a copy of an earlier commit's package and benchmarks in
# $OLD: the load parsed its items' layouts itself) and this tree (prepare_restore parses them
# ahead) alternated, each with BUILD_S seconds between prepare_restore and the load (a model
# build), each beside the same load without verification; then the GPU tests of the load.
# From the repository root on the GPU machine:
#   OLD=.ab_old OUT=$OUT bash docs/benchmarks/steps/layouts_ahead_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source docs/benchmarks/steps/_load_runs.sh
REPEATS=${REPEATS:-3} EXTRA="--build-s ${BUILD_S:-1}" load_runs ${ORDER:-old new old new}
MCX_TEST_DEVICE=cuda MCX_TEST_WORLD=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/multirank/test_cuda_load.py --junitxml "$OUT/junit_cuda_load.xml" 2>&1 | tail -3
