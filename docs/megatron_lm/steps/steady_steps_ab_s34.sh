#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): does anything of ours cost a steady training step?
# In the thirty-fourth session's first call our steps ran ~25 % slower than stock's over a whole
# 134M run (median 0.060 s against 0.048 s), where earlier sessions' runs had ours faster; those
# runs saved every 100 iterations. Here fresh runs of ITERS iterations (default 300) that save
# nothing in the window measured, ROUNDS rounds, modes alternated:
#   ours         the launcher with our flags and --save (the staging prepared after the first
#                step, the writer process up; the only save is at the end, outside the window)
#   ours_nosave  the launcher without --save (nothing prepared)
#   stock        Megatron-LM's own checkpointing with --save (its writer started likewise)
#   plain        stock without --save and without --async-save (no checkpointing at all)
# Per run: the median and mean step time over iterations 30..ITERS-1 (the log's stamps), which
# leaves the preparation (~1-2 s at 134M) and the final save out. Writes $OUT/steady_$MODEL.jsonl
# and $OUT/steady_logs_$MODEL.tgz.
#   OUT=$OUT MODEL=134m ROUNDS=2 bash docs/megatron_lm/steps/steady_steps_ab_s34.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source scripts/mlm_recipe.sh
mlm_ready || exit 2
MODEL=${MODEL:-134m}; ROUNDS=${ROUNDS:-2}; ITERS=${ITERS:-300}
MODES=${MODES:-ours stock ours_nosave plain}
mlm_model "$MODEL" || exit 2  # MARGS
export CUDA_DEVICE_MAX_CONNECTIONS=1
W=/tmp/st_$MODEL; L=/tmp/st_logs_$MODEL; rm -rf "$W" "$L"; mkdir -p "$W" "$L"
BASE=("${COMMON[@]}" "${MARGS[@]}" --train-iters "$ITERS" --save-interval "$ITERS"
      --lr-decay-iters 1000 --logging-level 20)
LINES="$OUT/steady_$MODEL.jsonl"; : > "$LINES"
parse() {  # LOG ROUND MODE
  python3 - "$1" "$2" "$3" "$LINES" "$ITERS" <<'PY'
import json, re, statistics, sys
from datetime import datetime
log, rnd, mode, out, iters = sys.argv[1:6]
text = open(log, errors="replace").read()
its = [(int(n), datetime.fromisoformat(t))
       for t, n in re.findall(r"\[([0-9-]+ [0-9:.]+)\] iteration +([0-9]+)/", text)]
steps = [(n, (b - a).total_seconds()) for (_, a), (n, b) in zip(its, its[1:])]
window = [s for n, s in steps if 30 <= n < int(iters)]
row = {"round": int(rnd), "mode": mode, "steps": len(window)}
if window:
    row.update(median_s=round(statistics.median(window), 5),
               mean_s=round(statistics.mean(window), 5))
open(out, "a").write(json.dumps(row) + "\n")
print(json.dumps(row))
PY
}
one() {  # ROUND MODE
  local log="$L/${MODEL}_r$1_$2.log" launch=(-m megatron_ckpt_ext.launch) flags=("${OURS[@]}")
  local saving=(--save "$W/save_$1_$2")
  case $2 in
    stock) launch=() ;;
    plain) launch=(); flags=(); saving=() ;;
    ours_nosave) saving=() ;;
  esac
  timeout 240 python3 -m torch.distributed.run --nproc-per-node 1 \
    --master-port $((29500 + RANDOM % 1000)) "${launch[@]}" .mlm/pretrain_gpt.py "${BASE[@]}" \
    "${flags[@]}" "${saving[@]}" > "$log" 2>&1
  echo "rc=$? $2 round $1"
  parse "$log" "$1" "$2"
  rm -rf "$W/save_$1_$2"; python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1
}
for r in $(seq 1 "$ROUNDS"); do
  order=($MODES); [ $((r % 2)) -eq 0 ] && order=($(printf '%s\n' "${order[@]}" | tac))
  for m in "${order[@]}"; do one "$r" "$m"; done
  tar -czf "$OUT/steady_logs_$MODEL.tgz" -C "$L" .
done
rm -rf "$W" "$L"
