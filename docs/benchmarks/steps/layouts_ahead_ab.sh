#!/usr/bin/env bash
# One GPU: 8 GiB warm loads, old code (a copy of an earlier commit's package and benchmarks in
# $OLD: the load parsed its items' layouts itself) and this tree (prepare_restore parses them
# ahead) alternated, each with BUILD_S seconds between prepare_restore and the load (a model
# build), each beside the same load without verification; then the GPU tests of the load.
# From the repository root on the GPU machine:
#   OLD=.ab_old OUT=$OUT bash docs/benchmarks/steps/layouts_ahead_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
i=0
for v in ${ORDER:-old new old new}; do
  i=$((i + 1))
  if [[ $v == old ]]; then root=$OLD; path=$PWD/$OLD:$PWD/.site; else root=.; path=$PWD:$PWD/.site; fi
  PYTHONPATH=$path timeout -k 10 170 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    "$root/benchmarks/bench_load.py" --gib "${GIB:-8}" --repeats "${REPEATS:-3}" --sources ours ours_no_verify \
    --caches warm --build-s "${BUILD_S:-1}" --out /tmp/bl --json "$OUT/load8_${v}_$i.json" > "/tmp/load8_${v}_$i.log" 2>&1
  echo "$v run=$i rc=$?"; grep "bench_load\]" "/tmp/load8_${v}_$i.log" | cut -c1-200
  rm -rf /tmp/bl
done
MCX_TEST_DEVICE=cuda MCX_TEST_WORLD=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/multirank/test_cuda_load.py --junitxml "$OUT/junit_cuda_load.xml" 2>&1 | tail -3
