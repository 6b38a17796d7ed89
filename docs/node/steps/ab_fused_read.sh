#!/usr/bin/env bash
# A record of the call that measured docs/notes/node.md and part of docs/notes/memory.md, not a
# command to rerun as is: .ab/ (not committed) held the variant files: load_reader.py and
# load_sums.py of 7d19203 (the old load path; the tree carried the fused change of
# fused_read_sum.patch), and retained.py with ../../memory/steps/bounce_per_thread_3878d54.patch
# applied (retained_lazy.py), plus 1 MiB copy-and-sum pieces (retained_lazy_fused.py).
# A/B on one GPU: the load's fused read+sum vs the old summing threads; the memory restore's
# bounce variants. Each variant is a copy of the tree with the old/new files overlaid.
set -u
R=$PWD; A=$OUT/ab; mkdir -p $A
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $R/.site $R/.whl/*.whl || exit 1
mk() { rm -rf /tmp/t_$1; mkdir /tmp/t_$1; (cd $R && tar cf - --exclude=.site --exclude=.whl --exclude=.mlm --exclude=.git .) | tar xf - -C /tmp/t_$1; }
mk old; cp .ab/load_reader.py .ab/load_sums.py /tmp/t_old/megatron_ckpt_ext/backend/
mk lazy; cp .ab/retained_lazy.py /tmp/t_lazy/megatron_ckpt_ext/staging/retained.py
mk lazyf; cp .ab/retained_lazy_fused.py /tmp/t_lazyf/megatron_ckpt_ext/staging/retained.py
T0=$(date +%s)
step() { # NAME TREE TIMEOUT cmd...
  local n=$1 t=$2 to=$3; shift 3
  (cd $t && PYTHONPATH=$t:$R/.site timeout -k 5 $to "$@") > $A/$n.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $n rc=$rc"; grep -E "^\[bench_load\]|^\[restore\]" $A/$n.log | cut -c1-330
}
L1=(python3 benchmarks/bench_load.py --gib 8 --repeats 2 --sources ours ours_no_verify --caches warm --out /tmp/l1)
L8=(python3 -m torch.distributed.run --standalone --nproc-per-node 8 benchmarks/bench_load.py --gib 2 --repeats 2 --sources ours ours_no_verify --caches warm --out /tmp/l8)
M=(python3 benchmarks/bench_memory_restore.py --gib 8 --saves 2 --repeats 3 --cases ours-memory ours-storage-warm --out /tmp/mr)
step load1_old /tmp/t_old 100 "${L1[@]}" --json $A/load1_old.json
step load1_new $R 100 "${L1[@]}" --json $A/load1_new.json
step load8_old /tmp/t_old 120 "${L8[@]}" --json $A/load8_old.json
step load8_new $R 120 "${L8[@]}" --json $A/load8_new.json
step mem_cur $R 100 "${M[@]}" --json $A/mem_cur.json
step mem_lazyf /tmp/t_lazyf 100 "${M[@]}" --json $A/mem_lazyf.json
step mem_lazy /tmp/t_lazy 100 "${M[@]}" --json $A/mem_lazy.json
tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $A
