#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm .ab_old): the first save after a storage resume, repeated,
# for two package versions in one call. Megatron-LM's pretrain_gpt.py through the launcher, ours
# only (scripts/mlm_recipe.sh's flags, MODEL's shape): one run trains to 2 x EVERY (saves every
# EVERY); then REPEATS rounds, each resuming once per ARMS entry from a copy of that checkpoint
# (storage, --no-ckpt-memory-restore, its pages warm after the first round) into a fresh --save
# root, training to 2 x EVERY + 120 with --save-interval 50: the first save after the resume
# (at +50), a steady one (+100) and the end-of-training save (+120), each write spaced to fit.
# ARMS: "new" (this tree) and "old" (the package in .ab_old: rm -rf .ab_old; mkdir .ab_old;
# git archive REV megatron_ckpt_ext | tar -x -C .ab_old), run with PYTHONSAFEPATH=1 so that
# torchrun's -m does not put this repository ahead of .ab_old; the order alternates a round.
# Prints and writes a line per resume to $OUT/first_after_resume_$MODEL.jsonl (Megatron's
# save-checkpoint timer per save; from the save root's ckpt_report.jsonl our blocking and phases;
# the package imported) and
# the logs to $OUT/first_after_resume_logs_$MODEL.tgz. From the repository root:
#   OUT=$OUT MODEL=134m REPEATS=3 bash docs/megatron_lm/steps/first_after_resume_s39.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source scripts/mlm_recipe.sh
mlm_ready || exit 2
MODEL=${MODEL:-134m}; REPEATS=${REPEATS:-3}; ARMS=${ARMS:-new old}
mlm_model "$MODEL" || exit 2  # MARGS, EVERY
export CUDA_DEVICE_MAX_CONNECTIONS=1
W=/tmp/far_$MODEL; K=$W/train; L=/tmp/far_logs_$MODEL; rm -rf "$W" "$L"; mkdir -p "$W" "$L"
BASE=("${COMMON[@]}" "${MARGS[@]}" "${OURS[@]}" --lr-decay-iters 1000 --logging-level 20)
LINES="$OUT/first_after_resume_$MODEL.jsonl"; : > "$LINES"
python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1
timeout 200 python3 -m torch.distributed.run --nproc-per-node 1 -m megatron_ckpt_ext.launch \
  .mlm/pretrain_gpt.py "${BASE[@]}" --train-iters $((2 * EVERY)) --save-interval $EVERY \
  --save $K --load $K > "$L/train_$MODEL.log" 2>&1
echo "train rc=$? latest $(cat $K/latest_checkpointed_iteration.txt 2>/dev/null)"
mkdir -p $K.copy; cp $K/latest_checkpointed_iteration.txt $K.copy/
cp -r $K/iter_$(printf %07d $((2 * EVERY))) $K.copy/
python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1
one() {  # ROUND ARM
  local log="$L/${MODEL}_r$1_$2.log" path=$PYTHONPATH safe=""
  [ "$2" = old ] && { path=$PWD/.ab_old:$PYTHONPATH; safe=1; }
  env PYTHONPATH="$path" PYTHONSAFEPATH=$safe python3 -c \
    "import megatron_ckpt_ext as m; print('package:', m.__file__)" > "$log" 2>&1
  env PYTHONPATH="$path" PYTHONSAFEPATH=$safe timeout 150 python3 -m torch.distributed.run \
    --nproc-per-node 1 --master-port $((29500 + RANDOM % 1000)) -m megatron_ckpt_ext.launch \
    .mlm/pretrain_gpt.py "${BASE[@]}" "${RESUME[@]}" --train-iters $((2 * EVERY + 120)) \
    --override-opt_param-scheduler \
    --save-interval 50 --load $K.copy --save $W/save_r$1_$2 --no-ckpt-memory-restore \
    >> "$log" 2>&1
  local rc=$?
  cp "$W/save_r$1_$2/ckpt_report.jsonl" "$L/${MODEL}_r$1_$2_reports.jsonl" 2>/dev/null
  rm -rf "$W/save_r$1_$2"; python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1
  python3 - "$log" "$1" "$2" "$rc" "$LINES" "$L/${MODEL}_r$1_$2_reports.jsonl" <<'PY'
import json, os, re, sys
log, rnd, arm, rc, out, rep = sys.argv[1:7]
text = open(log, errors="replace").read()
pkg = re.search(r"package: (\S+)", text)
timers = [round(float(b) / 1000, 4) for _, b in
          re.findall(r"save-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)", text)]
reports = [json.loads(l) for l in open(rep)] if os.path.exists(rep) else []
load = re.search(r"load-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)", text)
row = {"round": int(rnd), "arm": arm, "rc": int(rc), "package": pkg.group(1) if pkg else None,
       "load_s": round(float(load.group(2)) / 1000, 4) if load else None,
       "save_s": timers,
       "blocking_s": [r.get("blocking_s") for r in reports],
       "iterations": [r.get("iteration") for r in reports],
       "phases": [{k: round(v * 1e3, 1) for k, v in (r.get("phases") or {}).items()}
                  for r in reports]}
open(out, "a").write(json.dumps(row) + "\n")
print(json.dumps({k: row[k] for k in ("round", "arm", "rc", "package", "load_s", "save_s",
                                      "blocking_s", "iterations")}))
PY
  return $rc
}
for r in $(seq 1 "$REPEATS"); do
  arms=($ARMS); [ $((r % 2)) = 0 ] && arms=($(printf '%s\n' "${arms[@]}" | tac))
  for a in "${arms[@]}"; do
    one "$r" "$a"; rc=$?; tar -czf "$OUT/first_after_resume_logs_$MODEL.tgz" -C "$L" .
    [ $rc = 0 ] || { echo "a resume failed (rc=$rc): stopping"; rm -rf "$W"; exit 1; }
  done
done
python3 - "$LINES" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for arm in dict.fromkeys(r["arm"] for r in rows):
    got = [r["save_s"] for r in rows if r["arm"] == arm and len(r["save_s"]) >= 3]
    if got:
        first, steady = [s[0] for s in got], [s[1] for s in got]
        print(arm, "first after resume", first, "steady", steady, "end", [s[2] for s in got],
              "first/steady median",
              round(statistics.median(f / s for f, s in zip(first, steady)), 2))
PY
rm -rf "$W"
