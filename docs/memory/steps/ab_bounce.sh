#!/usr/bin/env bash
# A record of the call behind the bounce table of docs/notes/memory.md, not a command to rerun as
# is: .ab/ (not committed) held retained.py of 7d19203 (r16.py), with bounce_4mib.patch applied
# (r4.py), and with bounce_4mib_hostalloc.patch on top of that (r4p.py).
# A/B on one GPU: the memory restore's bounce chunk size and pinning.
set -u
R=$PWD; A=$OUT/ab; mkdir -p $A
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $R/.site $R/.whl/*.whl || exit 1
PYTHONPATH=$R:$R/.site python3 -c "from megatron_ckpt_ext import _crc; import isal; print('crc', _crc.IMPLEMENTATION, isal.__version__)"
mk() { rm -rf /tmp/t_$1; mkdir /tmp/t_$1; (cd $R && tar cf - --exclude=.site --exclude=.whl --exclude=.mlm --exclude=.git .) | tar xf - -C /tmp/t_$1; cp .ab/$1.py /tmp/t_$1/megatron_ckpt_ext/staging/retained.py; }
mk r16; mk r4; mk r4p
T0=$(date +%s)
step() { # NAME TREE TIMEOUT cmd...
  local n=$1 t=$2 to=$3; shift 3
  (cd $t && PYTHONPATH=$t:$R/.site timeout -k 5 $to "$@") > $A/$n.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $n rc=$rc"; grep -E "^\[restore\]" $A/$n.log | cut -c1-420
}
M=(python3 benchmarks/bench_memory_restore.py --gib 8 --saves 2 --repeats 3 --cases ours-memory --out /tmp/mr)
for v in r16 r4 r4p; do step mem_$v /tmp/t_$v 130 "${M[@]}" --json $A/mem_$v.json; done
step mem_r16b /tmp/t_r16 130 "${M[@]}" --json $A/mem_r16b.json
tar czf $OUT/ab2.tgz -C $OUT ab && rm -rf $A
