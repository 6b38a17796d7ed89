#!/usr/bin/env bash
# NPROC ranks: a process's first load after prepare_restore and BUILD_S seconds of "model
# build", old code ($OLD: an earlier commit's package, this tree's bench_load.py) and this tree
# alternated; verifying, then unverifying, each process's first load and its second.
#   OLD=.ab_old OUT=$OUT NPROC=4 bash docs/node/steps/first_load_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NPROC=${NPROC:-4}; GIB=${GIB:-2}
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
for v in ${ORDER:-old new}; do
  if [[ $v == old ]]; then root=$OLD; else root=.; fi
  PYTHONPATH=$PWD/$root:$PWD/.site timeout -k 10 200 "${TR[@]}" "$root/benchmarks/bench_load.py" \
    --ranks-per-device auto --gib "$GIB" --repeats 2 --sources ours --caches warm \
    --build-s "${BUILD_S:-2}" --out /tmp/fl --json "$OUT/first_${v}.json" > "$OUT/first_${v}.log" 2>&1
  echo "$v rc=$?"; grep "bench_load\]" "$OUT/first_${v}.log" | cut -c1-160; rm -rf /tmp/fl
done
