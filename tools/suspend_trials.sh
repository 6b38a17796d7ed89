#!/usr/bin/env bash
# A suspended job, as SLURM's `scontrol suspend` (and preemption by suspension) does it, N times:
# the README's GPT trainer (scripts/pretrain_gpt.py, 2 CPU ranks; one layer of 1024 and a vocabulary
# of 131072: 1.8 GB a rank, a write of ~3 s; async saves, persistent worker, cpu-shm, constant
# structure, a save every iteration, the 2 newest kept, --ckpt-timeout 15) under
# torch.distributed.run; a few seconds after the first commit every process of the job (the
# launcher and its descendants) gets SIGSTOP, STOP_S seconds later SIGCONT; with SUSPEND=freezer
# the job runs in a cgroup of its own, frozen and thawed instead (SLURM's cgroup plugin, a
# container's pause: no signal; cgroup v1 freezer or v2 cgroup.freeze, needs root). Then:
# whether the job trained to its end (exit code), the write errors it logged, the tracker's
# iteration and `verify` of it. On 2 cores a training step takes about as long as a write, so
# the trainer seldom looks at a save still being written after the continue: the GPU script
# (docs/reliability/steps/suspend_real_client_s25.sh) is the one where the code before the
# fix failed.
#   [SUSPEND=freezer] bash tools/suspend_trials.sh [N] [OUT_DIR]   (docs/RELIABILITY.md,
#   "A suspended job")
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-5}; OUT=${2:-$(mktemp -d)}; STOP_S=${STOP_S:-25}; ITERS=${ITERS:-30}
tree() { echo "$1"; local c; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
SUSPEND=${SUSPEND:-sigstop}
if [ "$SUSPEND" = freezer ]; then
  if [ -w /sys/fs/cgroup/freezer ]; then CGROOT=/sys/fs/cgroup/freezer; FREEZE=freezer.state
    ON=FROZEN; OFF=THAWED
  else CGROOT=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts); FREEZE=cgroup.freeze
    ON=1; OFF=0
    [ -n "$CGROOT" ] && [ -w "$CGROOT" ] || { echo "SUSPEND=freezer: no writable cgroup" >&2
      exit 2; }
  fi
fi
for t in $(seq 1 "$N"); do
  D=$OUT/t$t; mkdir -p "$D"; CG=""
  if [ "$SUSPEND" = freezer ]; then CG=$CGROOT/mcx_suspend_$$_$t; mkdir "$CG"; fi
  # the job's first process joins the cgroup before it starts anything (its children inherit it)
  setsid bash -c '[ -z "$0" ] || echo $$ > "$0/cgroup.procs"; exec "$@"' "$CG" \
    python -m torch.distributed.run --nproc-per-node 2 --master-port $((29800 + t)) \
    scripts/pretrain_gpt.py --num-layers 1 --hidden-size 1024 --num-attention-heads 16 \
    --vocab-size 131072 \
    --seq-length 16 --micro-batch-size 1 --train-iters "$ITERS" --save "$D/ckpt" \
    --save-interval 1 --async-save --async-ckpt-use-cpu-shm --use-persistent-ckpt-worker \
    --ckpt-assume-constant-structure --ckpt-timeout 15 --most-recent-k 2 --logging-level 20 \
    > "$D/log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 240); do  # the first save committed (start-up takes ~12 s on 2 cores)
    [ -e "$D/ckpt/latest_checkpointed_iteration.txt" ] && break; sleep 0.25
  done
  sleep "$(python -c "print(2 + $t % 4 * 0.7)")"  # then a few saves on, varied per trial
  # every process of the job: torch elastic starts each rank in a session of its own, so the
  # launcher's process group is not the job; SIGSTOP cannot be caught or forwarded
  job=$(tree "$launcher")
  if [ -n "$CG" ]; then echo $ON > "$CG/$FREEZE"; else kill -STOP $job; fi
  at_stop=$(cat "$D/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  sleep "$STOP_S"
  if [ -n "$CG" ]; then echo $OFF > "$CG/$FREEZE"; else kill -CONT $job; fi
  wait "$launcher"; rc=$?
  [ -z "$CG" ] || rmdir "$CG" 2>/dev/null
  errors=$(grep -c "did not finish within\|failed on every rank" "$D/log")
  tracker=$(cat "$D/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  verdict=$([ "$tracker" = none ] ||
    python -m megatron_ckpt_ext verify "$D/ckpt" 2>&1 | grep -c '^OK')
  echo "trial $t ($SUSPEND): $(wc -w <<< "$job") processes stopped, tracker $at_stop at the stop;" \
    "exit $rc, write errors logged $errors, tracker $tracker (of $ITERS)," \
    "verified ${verdict:-n/a}"
  rm -rf "$D/ckpt"  # 1.8 GB a rank a checkpoint: only the log stays
done
python -m megatron_ckpt_ext shm clean 2>&1 | tail -1
