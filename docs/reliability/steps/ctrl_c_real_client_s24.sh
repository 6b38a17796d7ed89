#!/usr/bin/env bash
# Twenty-fourth session: a terminal's Ctrl-C to Megatron-LM's unmodified pretrain_gpt.py under
# our launcher, two ranks (DP2, one GPU each: nvidia-h200-x2, NCCL world, our collectives on
# their gloo group), no --exit-signal-handler, as tools/ctrl_c_trials.sh does on CPU: the tiny
# GPT saving every 10 iterations, SIGINT to the launcher's process group some seconds after the
# first commit, then how long until every process was gone, the tracker, `verify`. Carry .whl
# and .mlm:   OUT=$OUT bash docs/reliability/steps/ctrl_c_real_client_s24.sh [TRIALS]
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
source scripts/mlm_recipe.sh
mlm_ready || exit 2
mkdir -p "$OUT/site"
printf 'import faulthandler, signal, sys\nfaulthandler.register(signal.SIGUSR1, all_threads=True, file=sys.stderr)\n' > "$OUT/site/sitecustomize.py"
for t in $(seq 1 "${1:-3}"); do
  D=/tmp/ctrl_c_$t; rm -rf "$D"; mkdir -p "$D"
  PYTHONPATH=$OUT/site:$PYTHONPATH setsid python3 -m torch.distributed.run --nproc-per-node 2 \
    --master-port $((29660 + t)) -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py "${COMMON[@]}" \
    "${TINY[@]}" --global-batch-size 8 "${OURS[@]}" --save-interval 10 --train-iters 100000 --lr-decay-iters 100000 \
    --save "$D/ckpt" > "$OUT/t$t.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 240); do  # the first commit (or the launcher gone: its log says why)
    [ -f "$D/ckpt/latest_checkpointed_iteration.txt" ] || ! kill -0 "$launcher" 2>/dev/null && break
    sleep 0.5
  done
  sleep $((t * 2))
  kill -INT -- -"$launcher"; t0=$(date +%s.%N); left=1
  for _ in $(seq 1 240); do sleep 0.25; pgrep -f "$D/ckpt" > /dev/null || { left=0; break; }; done
  took=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  if [ $left = 1 ]; then
    pkill -USR1 -f "pretrain_gpt.py.*$D/ckpt"; sleep 3; pkill -9 -f "$D/ckpt"; sleep 1; took=">60"
  fi
  tracker=$(cat "$D/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  python3 -m megatron_ckpt_ext verify "$D/ckpt" > "$OUT/t${t}_verify.txt" 2>&1; rc=$?
  echo "trial $t: gone after ${took} s, tracker $tracker, verify rc $rc ($(grep -c '^OK' "$OUT/t${t}_verify.txt") OK), abandoned said: $(grep -c 'saves in flight are abandoned' "$OUT/t$t.log")" | tee -a "$OUT/trials.txt"
  rm -rf "$D"
done
