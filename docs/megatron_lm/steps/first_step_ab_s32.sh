#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): what a resume from storage costs the first training
# iterations through the launcher, against stock. Megatron-LM's pretrain_gpt.py (MODEL 134m or
# 1b), ours: one run to 2 x EVERY (committed), its pages read; then REPEATS rounds, each
# resuming from it once per MODES entry and training TRAIN_AFTER iterations:
#   ours          the launcher, a fresh --save (saved at the last iteration: an interval save,
#                 since stock's save after its training loop fails on this stack)
#   atload        ours with MCX_PREPARE_AT_LOAD=1: the staging prepared as the load returns (the
#                 default until the thirty-third session), not after the first training step
#   nosave        the launcher without --save (since the thirty-second session the load then
#                 prepares no staging: nothing allocated or pinned beside the first steps)
#   stock         Megatron-LM's own checkpointing, a fresh --save
#   stock_nosave  stock without --save
# Per resume: Megatron's load-checkpoint timer, the wall time of each of the first ten
# iterations (from the log's stamps, the first from "[before the start of training step]") and
# their sum, and (ours) the first save's blocking time and allocations. The resumes train to
# another --train-iters than the run: --override-opt_param-scheduler (else Megatron refuses the
# checkpoint's weight-decay horizon; the first call, thirty-third session, lost every resume so). Writes
# $OUT/first_step_$MODEL.jsonl and $OUT/first_step_logs_$MODEL.tgz.
# FRESH_STOCK=1 also starts stock fresh (its first ten iterations beside ours' fresh start).
#   OUT=$OUT MODEL=134m REPEATS=2 bash docs/megatron_lm/steps/first_step_ab_s32.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source scripts/mlm_recipe.sh
mlm_ready || exit 2
MODEL=${MODEL:-134m}; REPEATS=${REPEATS:-2}; MODES=${MODES:-ours nosave stock stock_nosave}
TRAIN_AFTER=${TRAIN_AFTER:-20}
mlm_model "$MODEL" || exit 2  # MARGS, EVERY
export CUDA_DEVICE_MAX_CONNECTIONS=1
W=/tmp/fs_$MODEL; L=/tmp/fs_logs_$MODEL; rm -rf "$W" "$L"; mkdir -p "$W" "$L"
BASE=("${COMMON[@]}" "${MARGS[@]}" --save-interval $EVERY --lr-decay-iters 1000 --logging-level 20)
LINES="$OUT/first_step_$MODEL.jsonl"; : > "$LINES"
parse() {  # LOG ROUND MODE REPORT: one JSON line of the run into $LINES
  python3 - "$1" "$2" "$3" "$LINES" "$4" <<'PY'
import json, os, re, sys
from datetime import datetime
log, rnd, mode, out, report = sys.argv[1:6]
text = open(log, errors="replace").read()
m = re.search(r"load-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)", text)
start = re.search(r"\[before the start of training step\] datetime: ([0-9-]+ [0-9:.]+)", text)
its = re.findall(r"\[([0-9-]+ [0-9:.]+)\] iteration +([0-9]+)/", text)
row = {"round": int(rnd), "mode": mode, "load_s": round(float(m.group(2)) / 1000, 4) if m else None}
if start and its:
    stamps = [datetime.fromisoformat(start.group(1))]
    stamps += [datetime.fromisoformat(t) for t, _ in its[:10]]
    row["iterations_s"] = [round((b - a).total_seconds(), 3) for a, b in zip(stamps, stamps[1:])]
    row["first_ten_s"] = round(sum(row["iterations_s"]), 3)
reports = [json.loads(l) for l in open(report)] if os.path.exists(report) else []
if reports:
    r = reports[0]
    row["first_save"] = {"iteration": r.get("iteration"), "blocking_s": r.get("blocking_s"),
                         "allocations": r.get("stage_detail", {}).get("allocations"),
                         "wait_prepare_s": r.get("phases", {}).get("wait_prepare_s")}
saves = re.findall(r"save-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)", text)
row["save_checkpoint_s"] = [round(float(b) / 1000, 4) for _, b in saves]
open(out, "a").write(json.dumps(row) + "\n")
print(json.dumps(row))
PY
}
python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1
timeout 300 python3 -m torch.distributed.run --nproc-per-node 1 -m megatron_ckpt_ext.launch \
  .mlm/pretrain_gpt.py "${BASE[@]}" "${OURS[@]}" --train-iters $((2 * EVERY)) --save $W/run \
  > "$L/run_$MODEL.log" 2>&1
echo "run rc=$? tracker $(cat $W/run/latest_checkpointed_iteration.txt)"
parse "$L/run_$MODEL.log" 0 fresh_ours "$W/run/ckpt_report.jsonl"  # a fresh start, for scale
if [ -n "${FRESH_STOCK:-}" ]; then  # stock's fresh start too, for its first ten iterations
  timeout 300 python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29611 \
    .mlm/pretrain_gpt.py "${BASE[@]}" "${OURS[@]}" --train-iters $((2 * EVERY)) \
    --save $W/fresh_stock > "$L/fresh_stock_$MODEL.log" 2>&1
  echo "fresh stock rc=$?"
  parse "$L/fresh_stock_$MODEL.log" 0 fresh_stock /nonexistent; rm -rf "$W/fresh_stock"
fi
python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1  # no memory tier: these resumes read storage
cat $W/run/iter_*/* > /dev/null
one() {  # ROUND MODE
  local log="$L/${MODEL}_r$1_$2.log" save=$W/save_$1_$2 launch=(-m megatron_ckpt_ext.launch)
  local ours=("${OURS[@]}" --no-ckpt-memory-restore) saving=(--save $save) envs=()
  case $2 in
    atload) envs=(MCX_PREPARE_AT_LOAD=1) ;;
    stock*) launch=(); ours=("${OURS[@]}") ;;  # Megatron's own flags; no flag of ours
  esac
  case $2 in *nosave) saving=() ;; esac
  env "${envs[@]}" timeout 200 python3 -m torch.distributed.run --nproc-per-node 1 \
    --master-port $((29500 + RANDOM % 1000)) "${launch[@]}" .mlm/pretrain_gpt.py "${BASE[@]}" \
    "${ours[@]}" "${RESUME[@]}" --load $W/run "${saving[@]}" --save-interval $TRAIN_AFTER \
    --override-opt_param-scheduler --train-iters $((2 * EVERY + TRAIN_AFTER)) > "$log" 2>&1
  echo "rc=$? $2 round $1"
  parse "$log" "$1" "$2" "$save/ckpt_report.jsonl"
  rm -rf "$save"; python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1
}
for r in $(seq 1 "$REPEATS"); do
  for m in $MODES; do one "$r" "$m"; tar -czf "$OUT/first_step_logs_$MODEL.tgz" -C "$L" .; done
done
rm -rf "$W"; tar -czf "$OUT/first_step_logs_$MODEL.tgz" -C "$L" . && rm -rf "$L"
