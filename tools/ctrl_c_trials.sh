#!/usr/bin/env bash
# A terminal's Ctrl-C, as a user does it, N times: the README's example loop (2 CPU ranks, async
# saves, persistent worker, cpu-shm, a save every 5 iterations) under torch.distributed.run in a
# session of its own, SIGINT to the launcher's process group after a few seconds of training
# (varied per trial), then: how long until every process of the job was gone, the tracker's
# iteration, and `python -m megatron_ckpt_ext verify` of it. A job alive after LIMIT seconds
# gets its ranks' Python stacks dumped (faulthandler on SIGUSR1) into its log, then SIGKILL.
# Each trial's close after the interrupt keeps its last sealed snapshot in /dev/shm, as any close
# after an error does (the memory tier); the tool ends with `python -m megatron_ckpt_ext shm
# clean`, which frees every snapshot on the node that no live process maps.
#   bash tools/ctrl_c_trials.sh [N] [OUT_DIR]      (docs/RELIABILITY.md, "Ctrl-C")
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-10}; OUT=${2:-$(mktemp -d)}; LIMIT=${LIMIT:-28}
mkdir -p "$OUT/site"
cat > "$OUT/site/sitecustomize.py" <<'PY'
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True, file=sys.stderr)
PY
for t in $(seq 1 "$N"); do
  D=$OUT/t$t; mkdir -p "$D"
  PYTHONPATH=$OUT/site${PYTHONPATH:+:$PYTHONPATH} setsid python -m torch.distributed.run \
    --nproc-per-node 2 --master-port $((29700 + t)) examples/train_loop.py --async-save \
    --async-ckpt-use-cpu-shm --use-persistent-ckpt-worker --save "$D/ckpt" --save-interval 5 \
    --train-iters 100000 > "$D/log" 2>&1 &
  launcher=$!
  sleep $((12 + t % 7))  # training has begun (start-up takes ~10 s on 2 cores)
  kill -INT -- -"$launcher"; t0=$(date +%s.%N); left=1
  for _ in $(seq 1 $((LIMIT * 4))); do
    sleep 0.25; pgrep -f "$D/ckpt" > /dev/null || { left=0; break; }
  done
  took=$(python -c "import time; print(f'{time.time() - $t0:.1f}')")
  if [ $left = 1 ]; then
    pkill -USR1 -f "train_loop.py.*$D/ckpt"; sleep 2; pkill -9 -f "$D/ckpt"; sleep 1
    took=">$LIMIT"
  fi
  tracker=$(cat "$D/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  verdict=$([ "$tracker" = none ] ||
    python -m megatron_ckpt_ext verify "$D/ckpt" 2>&1 | grep -c '^OK')
  echo "trial $t: gone after ${took} s, tracker $tracker, verified ${verdict:-n/a}"
done
python -m megatron_ckpt_ext shm clean 2>&1 | tail -1
