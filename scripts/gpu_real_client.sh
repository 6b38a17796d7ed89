#!/usr/bin/env bash
# What a Megatron-LM user sees through the launcher, ours vs stock, in one run on one GPU:
# Megatron-LM core_r0.19.0's pretrain_gpt.py UNMODIFIED, as
#   python -m torch.distributed.run --nproc-per-node 1 -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py ARGS
# (ours) and python -m torch.distributed.run --nproc-per-node 1 .mlm/pretrain_gpt.py ARGS (stock), with
# --async-save --use-persistent-ckpt-worker --async-ckpt-use-cpu-shm --ckpt-assume-constant-structure
# --dist-ckpt-workers 1 for both, a plain optimizer (megatron-core 0.19.2 without Apex/TE cannot
# resume a distributed one), saves every SAVE_EVERY iterations (spaced so each write fits).
# Per model (MODELS="134m 1b"):
#   train        ITERS iterations: saves first, steady..., end_of_training (ITERS is not a
#                multiple of SAVE_EVERY, so Megatron saves once more after its loop)
#   resume_cold  from train's last checkpoint, its pages dropped, to RESUME_ITERS (own --save):
#                load-checkpoint cold, first_after_resume, end_of_training
#   resume_warm  the same with the checkpoint's pages read first, no --save: load-checkpoint warm
# Ours only, the memory tier (KILL=1): kill -9 every process of a run (torchrun, trainer, writer)
# at a random time (0.1-1 s) after its save at 2*SAVE_EVERY committed and was sealed, relaunch the same command: its
# load-checkpoint timer and tier, its losses against train's, and a warm storage load of a copy
# of the same checkpoint (restart_storage).
# Floors in the same run: pinned device-to-host copy of the state's bytes, cold and warm reads.
# SOURCES="ours stock" (default) picks the sources (none: only the kill run, floors from its
# checkpoint); KILL=0 skips the kill; RESUME_COLD=0 the cold resume; RESUME_WARM=0 the warm resume.
# Several GPUs, one per rank (issue 33): NPROC=2 PAR_ARGS="--tensor-model-parallel-size 2"
# LAYOUT=tp2 runs every run with NPROC ranks in that layout; RESUME_STEP=200 resumes the cold
# resume from that iteration (--ckpt-step) to ITERS, so its losses compare with train's (bit-
# identical expected); OTHER_PAR_ARGS="--tensor-model-parallel-size 1" OTHER_LAYOUT=dp2 adds a
# resume of each source's train into that layout (resume_other, losses compared).
# OURS_ARGS="--ckpt-restore-prefetch" adds flags to our runs only. Diagnostics pass through to
# our runs: MCX_SYNC_POINTS=$OUT/logs/sync (docs/DEBUGGING.md) lists where each save waited for
# the device, and lands in logs.tgz.
# Writes $OUT/real_client.json (benchmarks/real_client.py) and $OUT/logs.tgz (the runs' logs and
# reports, runs.jsonl, floors, meta); prints the table.
#   OUT=$OUT MODELS="134m" bash scripts/gpu_real_client.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
WORK=${WORK:-/tmp/rc_work}
MODELS=${MODELS:-134m}
KILL=${KILL:-1}
SOURCES=${SOURCES:-ours stock}
RESUME_WARM=${RESUME_WARM:-1}
RESUME_COLD=${RESUME_COLD:-1}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
NPROC=${NPROC:-1}
LAYOUT=${LAYOUT:-single}
read -r -a PAR <<< "${PAR_ARGS:-}"
read -r -a OTHER_PAR <<< "${OTHER_PAR_ARGS:-}"
read -r -a OURS_EXTRA <<< "${OURS_ARGS:-}"  # our flags for our runs only (stock's parser lacks them)
OTHER_LAYOUT=${OTHER_LAYOUT:-}
RESUME_STEP=${RESUME_STEP:-}
OURS_ARGS=${OURS_ARGS:-}
export MODELS SOURCES KILL RESUME_WARM RESUME_COLD OURS_ARGS NPROC LAYOUT PAR_ARGS OTHER_PAR_ARGS OTHER_LAYOUT RESUME_STEP
export SAVE_EVERY_134M SAVE_EVERY_1B ITERS_1B RESUME_ITERS_1B  # unset ones stay unset
mkdir -p "$OUT/logs" && rm -rf "$WORK" && mkdir -p "$WORK"
export CUDA_DEVICE_MAX_CONNECTIONS=1
source scripts/mlm_recipe.sh  # COMMON, OURS, RESUME
mlm_ready || exit 2
RUNS="$OUT/runs.jsonl"; : > "$RUNS"
START=$(date +%s)

model_args() {  # MODEL -> the model's flags, SAVE_EVERY, ITERS, RESUME_ITERS
  case $1 in
    134m) MARGS=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
                 --max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 4
                 --global-batch-size 4)
          SAVE_EVERY=${SAVE_EVERY_134M:-100}; ITERS=350; RESUME_ITERS=450 ;;
    1b)   MARGS=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024
                 --max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 2
                 --global-batch-size 2)
          # 130 iterations (13 s on an H100) let each 12.2 GB write end before the next save
          SAVE_EVERY=${SAVE_EVERY_1B:-130}; ITERS=${ITERS_1B:-400}; RESUME_ITERS=${RESUME_ITERS_1B:-430}
          # Megatron and ours keep the latest only (Megatron asserts a multiple of --save-interval)
          MARGS+=(--save-retain-interval $((SAVE_EVERY * 1000))) ;;
  esac
}

# launch NAME SOURCE MODEL KIND -- megatron args... (foreground, bounded)
launch() {
  local name=$1 source=$2 model=$3 kind=$4; shift 5
  local cmd=(python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((29500 + RANDOM % 1000)))
  [ "$source" = ours ] && cmd+=(-m megatron_ckpt_ext.launch)
  cmd+=(.mlm/pretrain_gpt.py "$@")
  [ "$source" = ours ] && cmd+=("${OURS_EXTRA[@]}")
  [ "$kind" = resume_other ] || cmd+=("${PAR[@]}")  # later flags win in Megatron's parser
  timeout -k 10 "$RUN_TIMEOUT" "${cmd[@]}" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  record "$name" "$source" "$model" "$kind" "$rc" "${cmd[*]}"
  echo "[$(( $(date +%s) - START ))s] $name rc=$rc"
  [ $rc = 0 ] || grep -m3 -E "Error|error:|Traceback" "$OUT/logs/$name.log" | head -5
}

record() {
  python3 - "$RUNS" "$@" "$OUT/logs/$1.log" <<'PY'
import json, sys
runs, name, source, model, kind, rc, command, log = sys.argv[1:9]
with open(runs, "a") as f:
    f.write(json.dumps({"name": name, "source": source, "model": model, "kind": kind,
                        "rc": int(rc), "command": command, "log": log}) + "\n")
PY
}

pages() {  # drop|read DIR: the checkpoint's pages out of (or into) the page cache
  python3 - "$@" <<'PY'
import os, sys
what, root = sys.argv[1:3]
for d, _, files in os.walk(root):
    for f in files:
        fd = os.open(os.path.join(d, f), os.O_RDONLY)
        try:
            if what == "drop":
                os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 1 << 24):
                    pass
        finally:
            os.close(fd)
PY
}

floors() {  # DIR MODEL -> $OUT/floors_MODEL.json: pinned D2H of the state's bytes, cold/warm reads
  python3 - "$@" "$OUT/floors_$2.json" <<'PY'
import json, os, sys, time, threading
import torch
root, model, out = sys.argv[1:4]
files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
data = sum(os.path.getsize(f) for f in files)
res = {"checkpoint_bytes": data}
n = 0
for f in files:
    if f.endswith(".distcp"):
        n += os.path.getsize(f)
n //= int(os.environ.get("NPROC", "1"))  # the ranks' shards are in the same files
res["state_bytes_per_rank"] = n
src = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
dst = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
best = 1e9
for _ in range(3):
    torch.cuda.synchronize(); t = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t)
res["d2h_pinned_s"] = round(best, 4); res["d2h_pinned_gbps"] = round(n / best / 1e9, 2)
best = 1e9
for _ in range(3):
    torch.cuda.synchronize(); t = time.perf_counter(); src.copy_(dst); torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t)
res["h2d_pinned_gbps"] = round(n / best / 1e9, 2)
def read_all(drop):
    if drop:
        for f in files:
            fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
    def one(f):
        fd = os.open(f, os.O_RDONLY)
        try:
            while os.read(fd, 1 << 24):
                pass
        finally:
            os.close(fd)
    big = sorted(files, key=os.path.getsize, reverse=True)
    t = time.perf_counter()
    th = [threading.Thread(target=one, args=(f,)) for f in big]
    [x.start() for x in th]; [x.join() for x in th]
    return data / (time.perf_counter() - t) / 1e9
res["read_cold_gbps"] = round(max(read_all(True) for _ in range(2)), 2)
res["read_warm_gbps"] = round(max(read_all(False) for _ in range(2)), 2)
json.dump(res, open(out, "w"), indent=1); print(json.dumps(res))
PY
}

copy_committed() {  # SRC DST: the tracker and the checkpoint it names (not a newer partial one)
  local it name f; it=$(cat "$1/latest_checkpointed_iteration.txt"); name=$(printf 'iter_%07d' "$it")
  mkdir -p "$2"
  for f in "$1"/*; do
    case $(basename "$f") in iter_*) [ "$(basename "$f")" = "$name" ] || continue ;; esac
    cp -r "$f" "$2/"
  done
}

kill_run() {  # NAME MODEL SAVE_DIR -- args: start in its own group, kill -9 it after 2*SAVE_EVERY
  local name=$1 model=$2 dir=$3; shift 4
  local cmd=(python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((29500 + RANDOM % 1000))
             -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py "$@" "${OURS_EXTRA[@]}" "${PAR[@]}")
  setsid "${cmd[@]}" > "$OUT/logs/$name.log" 2>&1 &
  local pid=$! t0=$(date +%s) target=$((2 * SAVE_EVERY))
  until [ "$(cat "$dir/latest_checkpointed_iteration.txt" 2>/dev/null)" = "$target" ]; do
    sleep 0.2
    if ! kill -0 $pid 2>/dev/null || [ $(( $(date +%s) - t0 )) -gt "$RUN_TIMEOUT" ]; then
      echo "$name: no commit of $target"; kill -9 -- -$pid 2>/dev/null; return 1
    fi
  done
  # at a random time after the committed save's snapshot is sealed and before the next save
  # (100 iterations of the 134M take about 3 s: a kill inside the next save's staging leaves no
  # snapshot of either save, and the restart reads storage, correctly but measuring nothing)
  local w=0; until ls /dev/shm/mcxseal_*_0.json >/dev/null 2>&1 || [ $w -ge 50 ]; do
    sleep 0.1; w=$((w + 1)); done
  local delay; delay=$(python3 -c "import random; print(round(random.uniform(0.1, 1.0), 2))")
  sleep "$delay"
  # every process of the run: torchrun's group, and its trainer, which torchrun starts in a
  # session of its own, with the writer it forked (all name the --save directory)
  kill -9 -- -$pid 2>/dev/null; pkill -9 -f -- "--save $dir " ; wait $pid 2>/dev/null
  sleep 1; pgrep -f -- "--save $dir " && echo "$name: processes survived the kill"
  echo "[$(( $(date +%s) - START ))s] $name killed ${delay}s after the commit of $target" \
       "(tracker $(cat "$dir/latest_checkpointed_iteration.txt"))"
  record "$name" ours "$model" kill 137 "${cmd[*]}"
  ls -la /dev/shm | grep -c mcx > "$OUT/logs/${name}_shm_count.txt"
}

for model in $MODELS; do
  model_args "$model"
  # a fixed decay horizon: a resumed run trains to another --train-iters, and Megatron refuses a
  # scheduler whose total differs from the checkpoint's
  base=("${COMMON[@]}" "${MARGS[@]}" "${OURS[@]}" --save-interval "$SAVE_EVERY" --lr-decay-iters 1000)
  for source in $SOURCES; do
    [ "$source" = none ] && continue  # SOURCES=none: the kill run alone (KILL=1)
    d="$WORK/${source}_$model"
    iters=$ITERS
    # stock megatron-core 0.19.2 + nvrx 0.7.0 fails the save after the training loop ("Worker
    # cache miss", then hangs until the timeout: seen 4 times on 1 and 2 GPUs); STOCK_END_SAVE=0
    # (default) trains stock to the last save interval instead, so it makes no such save
    [ "$source" = stock ] && [ "${STOCK_END_SAVE:-0}" = 0 ] && iters=$((ITERS / SAVE_EVERY * SAVE_EVERY))
    launch "${source}_${model}_train" $source $model train -- "${base[@]}" --train-iters $iters --save "$d"
    cp "$d"/ckpt_report.jsonl "$OUT/logs/${source}_${model}_train_reports.jsonl" 2>/dev/null
    pages drop "$d"
    step=(); to=$RESUME_ITERS
    [ "$iters" = "$ITERS" ] || to=$((RESUME_ITERS / SAVE_EVERY * SAVE_EVERY))
    [ -n "$RESUME_STEP" ] && step=(--ckpt-step "$RESUME_STEP") && to=$iters
    if [ "$RESUME_COLD" = 1 ]; then
      launch "${source}_${model}_resume_cold" $source $model resume_cold -- "${base[@]}" \
        "${RESUME[@]}" --train-iters $to --load "$d" --save "${d}_r1" --logging-level 20 \
        --override-opt_param-scheduler "${step[@]}"
      cp "${d}_r1"/ckpt_report.jsonl "$OUT/logs/${source}_${model}_resume_cold_reports.jsonl" 2>/dev/null
      rm -rf "${d}_r1"
    fi
    if [ -n "$OTHER_LAYOUT" ]; then  # the other layout, from the same checkpoint, no --save
      launch "${source}_${model}_resume_other" $source $model resume_other -- "${base[@]}" \
        "${RESUME[@]}" --train-iters $to --load "$d" --logging-level 20 \
        --override-opt_param-scheduler "${step[@]}" "${OTHER_PAR[@]}"
    fi
    [ "$RESUME_WARM" = 1 ] || continue
    pages read "$d"
    launch "${source}_${model}_resume_warm" $source $model resume_warm -- "${base[@]}" \
      "${RESUME[@]}" --train-iters $((ITERS + 2)) --load "$d" --override-opt_param-scheduler
  done
  # the largest committed checkpoint of the model (a timed-out run can leave an empty iter_N)
  last=$(du -s "$WORK"/*_"$model"/iter_[0-9]* 2>/dev/null | sort -n | tail -1 | cut -f2)
  [ -n "$last" ] && floors "$last" "$model"
  if [ "$KILL" = 1 ]; then
    # the kill run's checkpoints and the copy of one of them need the disk (1B: 12 GB each; with
    # the sources' checkpoints still there the 64 GB disk filled and the restart wrote nothing)
    rm -rf "$WORK"/*_"$model"
    k="$WORK/kill_$model"
    kargs=("${base[@]}" --train-iters $ITERS --save "$k" --load "$k" --logging-level 20 --seed 1234)
    kill_run "ours_${model}_kill" "$model" "$k" -- "${kargs[@]}"
    copy_committed "$k" "${k}_copy"
    # no source run made a checkpoint (SOURCES=none): the floors from the killed run's
    [ -z "$last" ] && floors "$(ls -d "${k}_copy"/iter_[0-9]* | tail -1)" "$model"
    pages read "${k}_copy"
    launch "ours_${model}_restart" ours $model restart -- "${kargs[@]}"
    cp "$k"/ckpt_report.jsonl "$OUT/logs/ours_${model}_restart_reports.jsonl" 2>/dev/null
    launch "ours_${model}_restart_storage" ours $model resume_warm -- "${base[@]}" "${RESUME[@]}" \
      --train-iters $((2 * SAVE_EVERY + 2)) --load "${k}_copy" --no-ckpt-memory-restore \
      --logging-level 20 --override-opt_param-scheduler
  fi
  rm -rf "$WORK"/*_"$model"* 2>/dev/null
done

python3 - "$OUT/meta.json" <<'PY'
import json, sys, torch, importlib.metadata as md
import os
meta = {"device": torch.cuda.get_device_name(0), "world_size": int(os.environ["NPROC"]),
        "ranks_per_device": 1,  # one GPU per rank (torchrun's local rank picks the device)
        "layout": os.environ["LAYOUT"], "parallel_args": os.environ.get("PAR_ARGS", ""),
        "versions": {p: md.version(p) for p in ("megatron-core", "nvidia-resiliency-ext", "torch")},
        "command": " ".join(f"{k}={os.environ[k]!r}" for k in
                            ("MODELS", "SOURCES", "KILL", "RESUME_COLD", "RESUME_WARM", "NPROC", "PAR_ARGS",
                             "LAYOUT", "RESUME_STEP", "OTHER_PAR_ARGS", "OTHER_LAYOUT", "OURS_ARGS",
                             "SAVE_EVERY_134M", "SAVE_EVERY_1B", "ITERS_1B", "RESUME_ITERS_1B")
                            if os.environ.get(k)) + " OUT=$OUT bash scripts/gpu_real_client.sh"}
json.dump(meta, open(sys.argv[1], "w"))
PY
cmp=()
for model in $MODELS; do
  model_args "$model"
  cmp+=(--compare "ours_${model}_train" "ours_${model}_restart" $((2 * SAVE_EVERY + 1)))
  cmp+=(--compare "ours_${model}_train" "stock_${model}_train" 1)
  for source in $SOURCES; do
    [ -n "$RESUME_STEP" ] && cmp+=(--compare "${source}_${model}_train" "${source}_${model}_resume_cold" $((RESUME_STEP + 1)))
    [ -n "$OTHER_LAYOUT" ] && cmp+=(--compare "${source}_${model}_train" "${source}_${model}_resume_other" $((${RESUME_STEP:-$ITERS} + 1)))
  done
done
python3 - "$OUT" $MODELS <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); floors = {}
for m in sys.argv[2:]:
    f = out / f"floors_{m}.json"
    if f.exists():
        floors[m] = json.loads(f.read_text())
(out / "floors.json").write_text(json.dumps(floors))
PY
python3 benchmarks/real_client.py --runs "$RUNS" --out "$OUT/real_client.json" \
  --floor "$OUT/floors.json" --meta "$OUT/meta.json" "${cmp[@]}"
# two files back (the GPU machine returns at most 8): real_client.json, and the rest in logs.tgz
mv "$OUT/runs.jsonl" "$OUT/meta.json" "$OUT"/floors*.json "$OUT/logs/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "[$(( $(date +%s) - START ))s] done"
