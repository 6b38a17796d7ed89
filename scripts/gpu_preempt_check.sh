#!/usr/bin/env bash
# GPU check of preemption through the zero-edit launcher (one GPU, megatron-core 0.19.2 + nvrx):
# Megatron-LM core_r0.19.0's pretrain_gpt.py, unmodified, through
#   torchrun --nproc_per_node 1 -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py <args>
# with the tiny recipe (scripts/mlm_recipe.sh), our flags and Megatron's --exit-signal-handler,
# no save interval within reach. Once iteration SIGNAL_AT is logged the training process gets
# SIGTERM (as SLURM sends it); Megatron must save at the next iteration boundary through our
# Checkpointer and exit 0; the checkpoint must pass `python -m megatron_ckpt_ext verify`; a fresh
# run (same --train-iters, --exit-interval SAVED+3) must resume from it at the next iteration.
#
# Run from the repository root after the install line of docs/GPU.md (PYTHONPATH=$PWD:$PWD/.site),
# with .mlm/ carried:   OUT=$OUT bash scripts/gpu_preempt_check.sh
# Writes $OUT/preempt_check.json and the logs' iteration lines.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
WORK=${WORK:-/tmp/preempt_check_work}
SIGNAL_AT=${SIGNAL_AT:-40}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK"

source scripts/mlm_recipe.sh  # COMMON, TINY, OURS, RESUME
mlm_ready || exit 2  # scripts/mlm_recipe.sh: the .mlm files, megatron's datasets helper
LONG=(--train-iters 100000 --save-interval 100000)
LOG="$WORK/run.log"

timeout "$RUN_TIMEOUT" torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 1000)) \
  -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py "${COMMON[@]}" "${TINY[@]}" "${LONG[@]}" \
  "${OURS[@]}" --exit-signal-handler --save "$WORK/ckpt" > "$LOG" 2>&1 &
RUNNER=$!
SIGNALED_AT=""
for _ in $(seq 1 $((RUN_TIMEOUT * 10))); do
  if grep -qE "\biteration +$SIGNAL_AT/" "$LOG"; then
    # the training process: torchrun's child (timeout -> torchrun -> python)
    TRAINER=$(pgrep -P "$(pgrep -P $RUNNER | head -1)" | head -1)
    SIGNALED_AT=$(date +%s.%N)
    kill -TERM "$TRAINER"
    echo "SIGTERM to pid $TRAINER after iteration $SIGNAL_AT was logged"
    break
  fi
  kill -0 $RUNNER 2>/dev/null || break
  sleep 0.1
done
wait $RUNNER
RC=$?
EXITED_AT=$(date +%s.%N)
SAVED=$(cat "$WORK/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo "")
python3 -m megatron_ckpt_ext verify "$WORK/ckpt" > "$WORK/verify.txt" 2>&1
VERIFY_RC=$?
RESUME_RC=""
if [ -n "$SAVED" ]; then
  timeout "$RUN_TIMEOUT" torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 1000)) \
    -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py "${COMMON[@]}" "${TINY[@]}" \
    "${LONG[@]}" --exit-interval $((SAVED + 3)) "${OURS[@]}" --save "$WORK/ckpt" \
    --load "$WORK/ckpt" "${RESUME[@]}" > "$WORK/resume.log" 2>&1
  RESUME_RC=$?
fi
grep -E "adapter installed|\biteration +[0-9]+/|exiting program|SIGTERM|Traceback|Error" "$LOG" > "$OUT/preempt_run.log"
grep -E "adapter installed|\biteration +[0-9]+/|loaded checkpoint|Traceback|Error" "$WORK/resume.log" > "$OUT/preempt_resume.log" 2>/dev/null
cp "$WORK/verify.txt" "$OUT/preempt_verify.txt"
python3 - "$OUT/preempt_check.json" "$LOG" "$WORK/resume.log" "$RC" "$SAVED" "$VERIFY_RC" \
  "${RESUME_RC:-}" "$SIGNAL_AT" "${SIGNALED_AT:-}" "$EXITED_AT" "$WORK/ckpt" <<'PY'
import json, re, sys
from pathlib import Path
out, log, resume_log, rc, saved, verify_rc, resume_rc, signal_at, signaled, exited, ckpt = sys.argv[1:12]
ITER = re.compile(r"\biteration\s+(\d+)/")
text = Path(log).read_text(errors="replace")
resumed = Path(resume_log).read_text(errors="replace") if Path(resume_log).exists() else ""
logged = [int(m.group(1)) for m in ITER.finditer(text)]
resumed_its = [int(m.group(1)) for m in ITER.finditer(resumed)]
saved_it = int(saved) if saved.strip() else None
result = {
    "rc": int(rc),
    "signal_after_logged_iteration": int(signal_at),
    "last_logged_iteration": max(logged, default=None),
    "saved_iteration": saved_it,
    "megatron_exit_message": "exiting program after receiving SIGTERM" in text,
    "saved_by_adapter": saved_it is not None
        and Path(ckpt, f"iter_{saved_it:07d}", "mcx_manifest.json").exists(),
    "verify_rc": int(verify_rc),
    "signal_to_exit_s": round(float(exited) - float(signaled), 2) if signaled else None,
    "resume_rc": int(resume_rc) if resume_rc else None,
    "resume_first_iteration": min(resumed_its, default=None),
}
result["ok"] = (result["rc"] == 0 and result["megatron_exit_message"] and result["saved_by_adapter"]
                and saved_it is not None and saved_it >= int(signal_at) and result["verify_rc"] == 0
                and result["resume_rc"] == 0 and result["resume_first_iteration"] == saved_it + 1)
Path(out).write_text(json.dumps(result, indent=1))
print(json.dumps(result))
PY
