#!/usr/bin/env bash
# GPU verification of the Megatron-LM adapter (one H100, megatron-core 0.19.2 + nvrx 0.7.0).
#
# Run from the repository root after the lead's install line (PYTHONPATH=$PWD:$PWD/.site), with
# .mlm/ carried (pretrain_gpt.py, gpt_builders.py, model_provider.py of Megatron-LM core_r0.19.0):
#   OUT=$OUT bash scripts/gpu_megatron_lm.sh
# Loss part (tiny GPT, 20 iterations, save every 5):
#   on      adapter on: --async-save --async-ckpt-use-cpu-shm --ckpt-assume-constant-structure
#           --dist-ckpt-workers 1
#   resume  adapter on, resumed from on's iteration 10 (through the tracker file) to 20
#   stock   adapter off, same 20 iterations, same saves
#   s2o     adapter on, resumed from stock's iteration 10;  o2s: stock, resumed from on's
# LOSS=all (default) runs the five loss runs; LOSS=min only on + resume; LOSS=0 none.
# Perf part (PERF=1, default): the 134M baseline (8 x 1024, distributed optimizer, save every 3),
# adapter on and stock, stall per save from the step start times.
# PERF_SPACED=N adds the 134M recipe (adapter on) saving every N iterations (see below).
# OVERLAP=1 adds on_ovl (= on + --ckpt-overlap-snapshot) and resume_ovl (from its iteration 10):
#   its losses must equal on's bit for bit (1-20), and the resume its own (11-20).
# PERF_OVERLAP=N adds the 134M recipe saving every N iterations with and without
#   --ckpt-overlap-snapshot, and the same loop without checkpointing: the iteration-time
#   increase around each save (the two step gaps after it, whose optimizer step waits for the
#   copies) against that loop's median step.
# RESUME_PERF=1 adds the resume timing (issue 22): the 134M recipe without the distributed
#   optimizer (megatron-core 0.19.2 without Apex/TE cannot resume one, stock too) saves at
#   iteration 3, adapter on and stock; each is then resumed to iteration 5 twice, the
#   checkpoint's pages dropped from the page cache (cold) and read into it (warm): Megatron's
#   load-checkpoint timer and the wall time from launch to the first iteration.
# Writes $OUT/mlm_results.json (+ logs) and prints a table. Budget: < 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
WORK=${WORK:-/tmp/mlm_work}
PERF=${PERF:-1}
LOSS=${LOSS:-all}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
mkdir -p "$OUT/logs" && rm -rf "$WORK" && mkdir -p "$WORK"
START=$(date +%s)

source scripts/mlm_recipe.sh  # COMMON, TINY, OURS, RESUME
mlm_ready || exit 2  # scripts/mlm_recipe.sh: the .mlm files, megatron's datasets helper
python3 -m megatron_ckpt_ext doctor --json > "$OUT/doctor.json" 2> "$OUT/logs/doctor.err" || true

BIG=(--use-distributed-optimizer --num-layers 8 --hidden-size 1024 --num-attention-heads 16
  --seq-length 1024 --max-position-embeddings 1024 --vocab-size 32000
  --micro-batch-size 4 --global-batch-size 4)
STOCK_ASYNC=(--async-save --use-persistent-ckpt-worker --ckpt-assume-constant-structure --dist-ckpt-workers 1)

# run NAME MODE(on|stock) -- megatron args...
run() {
  local name=$1 mode=$2; shift 3
  local extra=(); [ "$mode" = stock ] && extra=(--stock)
  local t0=$(date +%s.%N)
  MLM_RECORD="$WORK/$name.jsonl" MLM_REPORTS="$OUT/reports_$name.json" \
    timeout "$RUN_TIMEOUT" torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 1000)) \
    scripts/pretrain_gpt_megatron.py "${extra[@]}" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "{\"run\": \"$name\", \"rc\": $rc, \"t0\": $t0, \"wall_s\": $(python3 -c "import time;print(round(time.time()-$t0,1))")}" >> "$WORK/runs.jsonl"
  cp -f "$WORK/$name.jsonl" "$OUT/logs/" 2>/dev/null
  echo "[$(( $(date +%s) - START ))s] $name rc=$rc"; LAST_RC=$rc
  [ $rc = 0 ] || { grep -m2 -A12 "^Traceback" "$OUT/logs/$name.log" | head -40; grep -m5 -E "^[A-Za-z.]*(Error|Exception)" "$OUT/logs/$name.log"; }
}

# resume_dir SRC DST ITER: DST holds SRC's iter_ITER and a tracker naming it (resume via tracker).
resume_dir() {
  local it; it=$(printf 'iter_%07d' "$3"); mkdir -p "$2"
  cp -r "$1/$it" "$2/" && echo "$3" > "$2/latest_checkpointed_iteration.txt"
}

T=(--train-iters 20 --save-interval 5)
if [ "$LOSS" != 0 ]; then
run on on -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --save "$WORK/on"
resume_dir "$WORK/on" "$WORK/resume" 10
run resume on -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --save "$WORK/resume" --load "$WORK/resume" "${RESUME[@]}"
fi
if [ "$LOSS" = all ]; then
run stock stock -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${STOCK_ASYNC[@]}" --save "$WORK/stock"
resume_dir "$WORK/stock" "$WORK/s2o" 10
run s2o on -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --save "$WORK/s2o" --load "$WORK/s2o" "${RESUME[@]}"
resume_dir "$WORK/on" "$WORK/o2s" 10
run o2s stock -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${STOCK_ASYNC[@]}" --save "$WORK/o2s" --load "$WORK/o2s" "${RESUME[@]}"
fi
if [ "${OVERLAP:-0}" = 1 ]; then
run on_ovl on -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --ckpt-overlap-snapshot --save "$WORK/on_ovl"
resume_dir "$WORK/on_ovl" "$WORK/resume_ovl" 10
run resume_ovl on -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --ckpt-overlap-snapshot --save "$WORK/resume_ovl" --load "$WORK/resume_ovl" "${RESUME[@]}"
rm -rf "$WORK/on_ovl" "$WORK/resume_ovl"
fi
ls -R "$WORK/on" > "$OUT/logs/on_tree.txt" 2>&1
rm -rf "$WORK/on" "$WORK/stock" "$WORK/resume" "$WORK/s2o" "$WORK/o2s"

if [ "$PERF" = 1 ] && [ $(( $(date +%s) - START )) -lt 300 ]; then
  P=(--train-iters 16 --save-interval 3)
  run perf_on on -- "${COMMON[@]}" "${BIG[@]}" "${P[@]}" "${OURS[@]}" --save "$WORK/perf_on"
  rm -rf "$WORK/perf_on"
  if [ "${PERF_STOCK:-1}" = 1 ] && [ $(( $(date +%s) - START )) -lt 420 ]; then
    run perf_stock stock -- "${COMMON[@]}" "${BIG[@]}" "${P[@]}" "${STOCK_ASYNC[@]}" --save "$WORK/perf_stock"
    rm -rf "$WORK/perf_stock"
  fi
fi
# PERF_SPACED=N (off by default): the 134M recipe adapter on, saving every N iterations (3 saves),
# so each write can finish before the next save is due: the stall without the wait for the disk.
if [ "${PERF_SPACED:-0}" != 0 ] && [ $(( $(date +%s) - START )) -lt 420 ]; then
  run perf_spaced on -- "${COMMON[@]}" "${BIG[@]}" --train-iters $((3 * PERF_SPACED + 4)) \
    --save-interval "$PERF_SPACED" "${OURS[@]}" --save "$WORK/perf_spaced"
  rm -rf "$WORK/perf_spaced"
fi

if [ "${PERF_OVERLAP:-0}" != 0 ]; then
  N=$PERF_OVERLAP; PI=(--train-iters $((3 * N + 4)))
  run perf_ovl on -- "${COMMON[@]}" "${BIG[@]}" "${PI[@]}" --save-interval "$N" "${OURS[@]}" --ckpt-overlap-snapshot --save "$WORK/perf_ovl"
  rm -rf "$WORK/perf_ovl"
  run perf_novl on -- "${COMMON[@]}" "${BIG[@]}" "${PI[@]}" --save-interval "$N" "${OURS[@]}" --save "$WORK/perf_novl"
  rm -rf "$WORK/perf_novl"
  run perf_nosave on -- "${COMMON[@]}" "${BIG[@]}" "${PI[@]}"
fi

# pages DIR cold|warm: drop the checkpoint files' pages from the page cache, or read them in.
pages() {
  python3 - "$1" "$2" <<'PY'
import os, sys
from pathlib import Path
for p in (p for p in Path(sys.argv[1]).rglob("*") if p.is_file()):
    fd = os.open(p, os.O_RDONLY)
    try:
        if sys.argv[2] == "cold":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, 64 << 20):
                pass
    finally:
        os.close(fd)
PY
}
if [ "${RESUME_PERF:-0}" = 1 ]; then
  RB=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
    --max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 4 --global-batch-size 4)
  run rp_save_on on -- "${COMMON[@]}" "${RB[@]}" --train-iters 3 --save-interval 3 "${OURS[@]}" --save "$WORK/rp_on"
  [ "${RP_PROBE:-0}" = 1 ] || run rp_save_stock stock -- "${COMMON[@]}" "${RB[@]}" --train-iters 3 --save-interval 3 "${STOCK_ASYNC[@]}" --save "$WORK/rp_stock"
  # RP_PROBE=1: the cold-read order probe on the saved checkpoint instead of the resumes
  if [ "${RP_PROBE:-0}" = 1 ]; then
    for th in 8 16; do python3 benchmarks/read_order_probe.py "$WORK/rp_on/iter_0000003" --threads $th --json "$OUT/read_order_$th.json"; done
  fi
  for cache in cold warm; do
    [ "${RP_PROBE:-0}" = 1 ] && break
    pages "$WORK/rp_on" $cache
    run rp_on_$cache on -- "${COMMON[@]}" "${RB[@]}" --train-iters 5 --save-interval 100 "${OURS[@]}" --load "$WORK/rp_on" --save "$WORK/rp_scratch_on_$cache" --override-opt_param-scheduler "${RESUME[@]}"
    [ "$LAST_RC" = 0 ] || break
    pages "$WORK/rp_stock" $cache
    run rp_stock_$cache stock -- "${COMMON[@]}" "${RB[@]}" --train-iters 5 --save-interval 100 "${STOCK_ASYNC[@]}" --load "$WORK/rp_stock" --save "$WORK/rp_scratch_stock_$cache" --override-opt_param-scheduler "${RESUME[@]}"
  done
  du -sb "$WORK/rp_on" "$WORK/rp_stock" > "$OUT/logs/rp_sizes.txt"
  rm -rf "$WORK"/rp_on "$WORK"/rp_stock "$WORK"/rp_scratch_*
fi

WORK="$WORK" OUT="$OUT" python3 - <<'PY'
import json, os, statistics
from pathlib import Path

work, out = Path(os.environ["WORK"]), Path(os.environ["OUT"])

def losses(name):
    path = work / f"{name}.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    return {r["iteration"]: r for r in rows}

def step_gaps(name):
    rows = losses(name)
    return {i: rows[i]["t"] - rows[i - 1]["t"] for i in sorted(rows) if i - 1 in rows}

def stalls(name, every, span=1, base=None):
    """Per save at iteration s: the step-start gaps s+1..s+span minus span plain steps (the
    median of this run's gaps not after a save, or ``base``)."""
    gaps = step_gaps(name)
    after = {i for i in gaps if any((i - k) % every == 0 for k in range(1, span + 1))}
    plain = [g for i, g in gaps.items() if i not in after and i > 3]
    base = base if base is not None else (statistics.median(plain) if plain else None)
    saves = sorted(i - 1 for i in gaps if (i - 1) % every == 0 and i - 1 + span in gaps)
    per_save = {s: round(sum(gaps[s + k] for k in range(1, span + 1)) - span * base, 4)
                for s in saves} if base else {}
    vals = list(per_save.values())
    return {"plain_step_s": round(base, 4) if base else None, "stall_s_by_save_iter": per_save,
            "first_save_stall_s": vals[0] if vals else None,
            "steady_stall_s_max": max(vals[1:]) if len(vals) > 1 else None}

def same(a, b, its):
    A, B = losses(a), losses(b)
    missing = [i for i in its if i not in A or i not in B]
    diff = [i for i in its if i in A and i in B and A[i]["loss_hex"] != B[i]["loss_hex"]]
    return {"equal_bitwise": not missing and not diff, "missing": missing, "differ": diff}

runs = [json.loads(l) for l in (work / "runs.jsonl").read_text().splitlines()] if (work / "runs.jsonl").exists() else []
tail = list(range(11, 21))
res = {
    "runs": runs,
    "losses_on": {i: r["loss"] for i, r in sorted(losses("on").items())},
    "resume_vs_on_11_20": same("on", "resume", tail),
    "stock_vs_on_1_20": same("on", "stock", list(range(1, 21))),
    "stock_to_on_11_20": same("on", "s2o", tail),
    "on_to_stock_11_20": same("on", "o2s", tail),
    "stall_tiny_on": stalls("on", 5), "stall_tiny_stock": stalls("stock", 5),
    "stall_134m_on": stalls("perf_on", 3), "stall_134m_stock": stalls("perf_stock", 3),
    "stall_134m_spaced": stalls("perf_spaced", int(os.environ.get("PERF_SPACED") or 0) or 1),
    "overlap_vs_on_1_20": same("on", "on_ovl", list(range(1, 21))),
    "resume_ovl_vs_on_ovl_11_20": same("on_ovl", "resume_ovl", tail),
}
n_ovl = int(os.environ.get("PERF_OVERLAP") or 0)
if n_ovl:
    nosave = [g for i, g in step_gaps("perf_nosave").items() if i > 3]
    base = statistics.median(nosave) if nosave else None
    res["step_134m_nosave_s"] = round(base, 4) if base else None
    for key, name in (("overlap", "perf_ovl"), ("no_overlap", "perf_novl")):
        res[f"stall_134m_{key}_same_run"] = stalls(name, n_ovl, span=2)
        res[f"stall_134m_{key}_vs_nosave"] = stalls(name, n_ovl, span=2, base=base) if base else None
def resume_times(name):
    """Megatron's load-checkpoint timer (max over ranks, s) and launch -> first iteration (s)."""
    import re
    log = out / "logs" / f"{name}.log"
    run = next((r for r in runs if r["run"] == name), None)
    if not log.exists() or run is None:
        return None
    timer = re.findall(r"load-checkpoint \.*: \(?([\d.]+)(?:, ([\d.]+))?", log.read_text())
    first = min(losses(name).values(), key=lambda r: r["iteration"], default=None)
    return {"rc": run["rc"], "load_checkpoint_timer_s": round(float(timer[-1][1] or timer[-1][0]) / 1e3, 3) if timer else None,
            "launch_to_first_iteration_s": round(first["t"] - run["t0"], 2) if first else None,
            "first_iteration": first["iteration"] if first else None}

if any(r["run"].startswith("rp_") for r in runs):
    res["resume_134m"] = {f"{who}_{cache}": resume_times(f"rp_{who}_{cache}")
                          for who in ("on", "stock") for cache in ("cold", "warm")}
    sizes = out / "logs" / "rp_sizes.txt"
    if sizes.exists():
        res["resume_134m"]["checkpoint_bytes"] = {Path(p).name: int(n) for n, p in
                                                  (l.split() for l in sizes.read_text().splitlines())}
for name in ("on", "perf_on", "perf_spaced", "on_ovl", "perf_ovl", "perf_novl", "rp_on_cold"):
    p = out / f"reports_{name}.json"
    if p.exists():
        res[f"adapter_reports_{name}"] = json.loads(p.read_text())
(out / "mlm_results.json").write_text(json.dumps(res, indent=1, default=str))
print(f"{'run':12} {'rc':>3} {'wall_s':>7}")
for r in runs:
    print(f"{r['run']:12} {r['rc']:>3} {r['wall_s']:>7}")
for key in ("resume_vs_on_11_20", "stock_vs_on_1_20", "stock_to_on_11_20", "on_to_stock_11_20",
            "overlap_vs_on_1_20", "resume_ovl_vs_on_ovl_11_20"):
    print(f"{key:22} bitwise_equal={res[key]['equal_bitwise']} missing={res[key]['missing']} differ={res[key]['differ']}")
print("step_134m_nosave_s", res.get("step_134m_nosave_s"))
for key, v in (res.get("resume_134m") or {}).items():
    print(f"resume_134m {key:12} {v}")
for key in ("stall_tiny_on", "stall_tiny_stock", "stall_134m_on", "stall_134m_stock", "stall_134m_spaced",
            "stall_134m_overlap_same_run", "stall_134m_overlap_vs_nosave",
            "stall_134m_no_overlap_same_run", "stall_134m_no_overlap_vs_nosave"):
    s = res.get(key)
    if not s:
        continue
    print(f"{key:18} plain_step={s['plain_step_s']} first={s['first_save_stall_s']} steady_max={s['steady_stall_s_max']} all={s['stall_s_by_save_iter']}")
PY
echo "total $(( $(date +%s) - START ))s"
