#!/usr/bin/env bash
# One GPU: the GPU tests of the load, then 8 GiB warm loads (verifying on the device, and
# without verification), old code (a copy of an earlier commit's package and benchmarks in
# $OLD: each reading thread waited for every copy) and this tree (a copy left in flight while
# the thread reads on) alternated; "new:16" runs this tree with 16 reading threads.
# From the repository root on the GPU machine:
#   OLD=.ab_old OUT=$OUT bash docs/benchmarks/steps/copies_in_flight_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
MCX_TEST_DEVICE=cuda MCX_TEST_WORLD=1 timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/multirank/test_cuda_load.py --junitxml "$OUT/junit_cuda_load.xml" 2>&1 | tail -3
i=0
for run in ${ORDER:-old new old new new:16}; do
  i=$((i + 1)); v=${run%%:*}; threads=()
  [[ $run == *:* ]] && threads=(--load-threads "${run##*:}")
  if [[ $v == old ]]; then root=$OLD; path=$PWD/$OLD:$PWD/.site; else root=.; path=$PWD:$PWD/.site; fi
  name="load8_${v}${threads[1]:+_t${threads[1]}}_$i"
  PYTHONPATH=$path timeout -k 10 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    "$root/benchmarks/bench_load.py" --gib "${GIB:-8}" --repeats "${REPEATS:-2}" --sources ours ours_no_verify \
    --caches warm "${threads[@]}" --out /tmp/bl --json "$OUT/$name.json" > "/tmp/$name.log" 2>&1
  echo "$run run=$i rc=$?"; grep "bench_load\]" "/tmp/$name.log" | cut -c1-220
  rm -rf /tmp/bl
done
