#!/usr/bin/env bash
# Twenty-fifth session: a job suspended whole while a save is being written, as SLURM's
# `scontrol suspend` (or preemption by suspension) does it: Megatron-LM's unmodified
# pretrain_gpt.py under our launcher, one GPU, the 134M GPT (1.88 GB a rank, a write of ~1-2 s),
# a save every 10 iterations (a write is in flight most of the time), --ckpt-timeout 10; a few
# seconds after the first commit SIGSTOP to every process of the job (the launcher and all its
# descendants: torch elastic starts each rank in a session of its own), SIGCONT STOP_S later;
# then the job's exit code, the write errors it logged, the tracker and `verify`. Each source
# (VARIANTS: "before" = the package in .ab_old, the code before the fix, run from inside .ab_old
# since a `-m` run puts its working directory first on sys.path; "after" = this tree) runs
# TRIALS trials. Carry .whl .mlm .ab_old:
#   OUT=$OUT TRIALS=2 bash docs/reliability/steps/suspend_real_client_s25.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
source scripts/mlm_recipe.sh
mlm_ready || exit 2
STOP_S=${STOP_S:-20}; ITERS=${ITERS:-250}
M134=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
  --max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 4 --global-batch-size 4)
tree() { echo "$1"; local c; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
for v in ${VARIANTS:-before after}; do
  ROOT=$PWD; pp=$PYTHONPATH; cwd=$ROOT
  [ "$v" = before ] && { pp=$ROOT/.ab_old:$PYTHONPATH; cwd=$ROOT/.ab_old; }
  (cd "$cwd" && PYTHONPATH=$pp python3 -c "import megatron_ckpt_ext as m; print('$v:', m.__file__)")
  for t in $(seq 1 "${TRIALS:-2}"); do
    D=/tmp/suspend_${v}_$t; rm -rf "$D"; mkdir -p "$D"
    (cd "$cwd" && PYTHONPATH=$pp exec timeout 300 python3 -m torch.distributed.run \
      --nproc-per-node 1 --master-port $((29670 + t)) -m megatron_ckpt_ext.launch \
      "$ROOT/.mlm/pretrain_gpt.py" \
      "${COMMON[@]}" "${M134[@]}" "${OURS[@]}" --ckpt-timeout 10 --save-interval 10 \
      --train-iters "$ITERS" --lr-decay-iters "$ITERS" --save "$D/ckpt") > "$OUT/${v}_t$t.log" 2>&1 &
    launcher=$!
    for _ in $(seq 1 240); do  # the first commit (or the launcher gone: its log says why)
      [ -f "$D/ckpt/latest_checkpointed_iteration.txt" ] || ! kill -0 "$launcher" 2>/dev/null && break
      sleep 0.5
    done
    sleep $((1 + t))
    job=$(tree "$launcher"); kill -STOP $job
    at_stop=$(cat "$D/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
    sleep "$STOP_S"; kill -CONT $job
    wait "$launcher"; rc=$?
    tracker=$(cat "$D/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
    PYTHONPATH=$pp python3 -m megatron_ckpt_ext verify "$D/ckpt" > "$OUT/${v}_t${t}_verify.txt" 2>&1
    echo "$v trial $t: $(wc -w <<< "$job") processes stopped, tracker $at_stop at the stop;" \
      "exit $rc, write errors logged $(grep -c 'did not finish within' "$OUT/${v}_t$t.log")," \
      "tracker $tracker (of $ITERS), verify OK lines $(grep -c '^OK' "$OUT/${v}_t${t}_verify.txt")" \
      | tee -a "$OUT/trials.txt"
    rm -rf "$D"
  done
done
python3 -m megatron_ckpt_ext shm clean 2>&1 | tail -1
