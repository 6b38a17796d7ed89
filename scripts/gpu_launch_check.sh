#!/usr/bin/env bash
# GPU check of the zero-edit launcher (one GPU, megatron-core 0.19.2 + nvrx):
# Megatron-LM core_r0.19.0's pretrain_gpt.py runs UNMODIFIED through
#   torchrun --nproc_per_node 1 -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py <args>
# with gpu_megatron_lm.sh's tiny GPT recipe (COMMON + TINY, copied), 20 iterations saving every 5
# with our flags (on), then a fresh run resumed from on's iteration 10 (through the tracker file)
# to 20 (resume). Megatron's "lm loss: X" and "grad norm: X" log lines (--log-interval 1) of
# iterations 11-20 must be identical as printed (%.6E; the launcher adds no exact-loss recorder:
# the script is unmodified), except that resume's iteration 12 logs the mean of its 11 and 12
# (Megatron does not reset the loss accumulator after a run's first iteration): it must equal
# (on 11 + on 12) / 2 to within the last printed digit.
#
# Run from the repository root after the lead's install line (PYTHONPATH=$PWD:$PWD/.site), with
# .mlm/ carried (pretrain_gpt.py, gpt_builders.py, model_provider.py of Megatron-LM core_r0.19.0):
#   OUT=$OUT bash scripts/gpu_launch_check.sh
# Writes $OUT/launch_check.json {"resume_bit_identical", "losses", "rc", ...} and the logs.
# ON_EXTRA_ARGS: more flags for on (e.g. "--save-retain-interval 10", Megatron's flag, which our
# Checkpointer reads too: $OUT/on_dir_listing.txt then lists what is left, iter_0000010 and 20).
# NPROC (1) ranks through torchrun with PAR_ARGS on every run, e.g. NPROC=8 PAR_ARGS="--tensor-model-
# parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8" (TP2 PP2 DP2; later
# flags win in Megatron's parser). Tried once with NPROC=2 TP2 on 2 H200s (2026-11-24): both runs
# stopped at Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 assertion, now exported here; not yet rerun.
# RESUME_B_ARGS="--ckpt-load-threads 1": one more resume from on's iteration 10 with these extra
# arguments (resume_b; compared with on into $OUT/launch_check_b.json), to tell two load paths apart.
# The comparison alone, on two existing logs (tests/functional/e2e/test_launch.py runs it on fake logs):
#   bash scripts/gpu_launch_check.sh --compare ON.log RESUME.log OUT.json RC_ON RC_RESUME SAVE_DIR
set -uo pipefail
cd "$(dirname "$0")/.."

# compare ON_LOG RESUME_LOG OUT_JSON RC_ON RC_RESUME SAVE_DIR: parse both logs, write the verdict.
compare() {
  python3 - "$@" <<'PY'
import json, re, sys
from pathlib import Path

on_log, resume_log, out, rc_on, rc_resume, save_dir = sys.argv[1:7]
# Megatron's training_log: "iteration       11/      20 | ... | lm loss: 1.012345E+01 | ..."
LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|.*?\blm loss: ([^ |]+)")


GRAD = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|.*?\bgrad norm: ([^ |]+)")


def losses(path, line=LINE):
    found = {}
    text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
    for match in line.finditer(text):
        found[int(match.group(1))] = match.group(2)
    return found


on, resume = losses(on_log), losses(resume_log)
grad_on, grad_resume = losses(on_log, GRAD), losses(resume_log, GRAD)
wanted = list(range(11, 21))
mismatches = [i for i in wanted if i not in on or i not in resume or on[i] != resume[i]]
grad_mismatches = [i for i in wanted if grad_on.get(i) != grad_resume.get(i)]


def ulp(text):  # one unit in the last printed digit of a %.6E value
    return 10.0 ** (int(text.split("E")[1]) - 6)


# Megatron 0.19's training_log does not reset its loss accumulator after the first iteration of a
# run (training.py: should_reset = not is_first_iteration), so a run's second logged loss is the
# mean of its first two: on's iteration 2 and resume's iteration 12. Identical training then
# logs resume[12] = (on[11] + on[12]) / 2, to within the print's rounding (one unit).
explained = {}
if 12 in mismatches and all(12 in d for d in (on, resume)) and 11 in on:
    mean = (float(on[11]) + float(on[12])) / 2
    if abs(float(resume[12]) - mean) <= 1.01 * ulp(resume[12]):
        explained[12] = (f"resume's second logged loss is the mean of its first two (Megatron's "
                         f"first-iteration rule): (on 11 + on 12) / 2 = {mean:.7E}")
rc = {"on": int(rc_on), "resume": int(rc_resume)}
installed = all("megatron-ckpt-ext adapter installed" in Path(p).read_text(errors="replace")
                for p in (on_log, resume_log) if Path(p).exists())
manifest = Path(save_dir, "iter_0000010", "mcx_manifest.json").exists()
result = {
    "resume_bit_identical": (not set(mismatches) - set(explained) and not grad_mismatches
                             and rc == {"on": 0, "resume": 0}),
    "losses": {"on": {str(k): v for k, v in sorted(on.items())},
               "resume": {str(k): v for k, v in sorted(resume.items())}},
    "compared_iterations": wanted,
    "mismatches": mismatches,
    "explained_mismatches": {str(k): v for k, v in explained.items()},
    "resume_started_at_11": min(resume, default=None) == 11,
    "rc": rc,
    "adapter_installed_logged": installed,
    "saved_by_adapter": manifest,  # our Checkpointer's integrity manifest, stock writes none
    "precision": "Megatron's log line, %.6E",
    "grad_norms": {"on": {str(k): grad_on.get(k) for k in wanted},
                   "resume": {str(k): grad_resume.get(k) for k in wanted}},
    "grad_norm_mismatches_11_20": grad_mismatches,
}
Path(out).write_text(json.dumps(result, indent=1))
print(json.dumps({k: result[k] for k in ("resume_bit_identical", "mismatches",
                                          "explained_mismatches", "rc",
                                          "resume_started_at_11", "saved_by_adapter")}))
PY
}

if [ "${1:-}" = --compare ]; then
  shift
  compare "$@"
  exit $?
fi

OUT=${OUT:?set OUT to the results folder}
WORK=${WORK:-/tmp/launch_check_work}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
mkdir -p "$OUT/logs" && rm -rf "$WORK" && mkdir -p "$WORK"

source scripts/mlm_recipe.sh  # COMMON, TINY, OURS, RESUME (as gpu_megatron_lm.sh)
mlm_ready || exit 2  # scripts/mlm_recipe.sh: the .mlm files, megatron's datasets helper

T=(--train-iters 20 --save-interval 5)
# Megatron-LM asserts this for tensor or context parallelism (its examples export it always)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# launch NAME -- args...: the unmodified script through the launcher; sets LAST_RC
launch() {
  local name=$1; shift 2
  timeout "$RUN_TIMEOUT" torchrun --nproc_per_node "${NPROC:-1}" --master_port $((29500 + RANDOM % 1000)) \
    -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py "$@" > "$OUT/logs/launch_$name.log" 2>&1
  LAST_RC=$?
  echo "launch $name rc=$LAST_RC"
  [ $LAST_RC = 0 ] || grep -m2 -A12 "^Traceback" "$OUT/logs/launch_$name.log" | head -40
}

# shellcheck disable=SC2086  # ON_EXTRA_ARGS: several flags, word-split on purpose
launch on -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --save "$WORK/on" ${PAR_ARGS:-} ${ON_EXTRA_ARGS:-}
RC_ON=$LAST_RC
# what on's save directory holds at the end (retention: ON_EXTRA_ARGS="--save-retain-interval 10")
sleep 2  # retention deletes in the background after the last commit
ls -A "$WORK/on" > "$OUT/on_dir_listing.txt"
mkdir -p "$WORK/resume"
cp -r "$WORK/on/iter_0000010" "$WORK/resume/" 2>/dev/null && echo 10 > "$WORK/resume/latest_checkpointed_iteration.txt"
# shellcheck disable=SC2086
launch resume -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --save "$WORK/resume" --load "$WORK/resume" "${RESUME[@]}" ${PAR_ARGS:-}
RC_RESUME=$LAST_RC
compare "$OUT/logs/launch_on.log" "$OUT/logs/launch_resume.log" "$OUT/launch_check.json" \
  "$RC_ON" "$RC_RESUME" "$WORK/on"
if [ -n "${RESUME_B_ARGS:-}" ]; then
  mkdir -p "$WORK/resume_b"
  cp -r "$WORK/on/iter_0000010" "$WORK/resume_b/" 2>/dev/null && echo 10 > "$WORK/resume_b/latest_checkpointed_iteration.txt"
  # shellcheck disable=SC2086  # word-split on purpose: several flags
  launch resume_b -- "${COMMON[@]}" "${TINY[@]}" "${T[@]}" "${OURS[@]}" --save "$WORK/resume_b" --load "$WORK/resume_b" "${RESUME[@]}" ${PAR_ARGS:-} $RESUME_B_ARGS
  compare "$OUT/logs/launch_on.log" "$OUT/logs/launch_resume_b.log" "$OUT/launch_check_b.json" \
    "$RC_ON" "$LAST_RC" "$WORK/on"
fi
