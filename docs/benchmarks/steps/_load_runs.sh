# Sourced by the load A/B step scripts (after _prologue.sh): load_runs RUN... runs one 8 GiB warm
# load benchmark per RUN, each beside the same load without verification, and prints its lines.
# A RUN is old or new (old: the package and benchmarks copied into $OLD; new: this tree), with
# ":N" for N reading threads (new:16). GIB, REPEATS and EXTRA (more bench_load flags) apply to
# every run; results go to $OUT/load8_<run>_<i>.json.
load_runs() {
  local i=0 run v name root path threads
  for run in "$@"; do
    i=$((i + 1)); v=${run%%:*}; threads=()
    [[ $run == *:* ]] && threads=(--load-threads "${run##*:}")
    if [[ $v == old ]]; then root=$OLD; path=$PWD/$OLD:$PWD/.site; else root=.; path=$PWD:$PWD/.site; fi
    name="load8_${v}${threads[1]:+_t${threads[1]}}_$i"
    PYTHONPATH=$path timeout -k 10 170 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
      "$root/benchmarks/bench_load.py" --gib "${GIB:-8}" --repeats "${REPEATS:-2}" --sources ours ours_no_verify \
      --caches warm "${threads[@]}" ${EXTRA:-} --out /tmp/bl --json "$OUT/$name.json" > "/tmp/$name.log" 2>&1
    echo "$run run=$i rc=$?"; grep "bench_load\]" "/tmp/$name.log" | cut -c1-220
    rm -rf /tmp/bl
  done
}
