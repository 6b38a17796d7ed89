#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): the restart of the real client repeated, to compare how
# a restore from memory is prepared by what the restarted job waits for (Megatron's
# model-and-optimizer-setup) beyond one run's spread. Megatron-LM's pretrain_gpt.py through the
# launcher, ours only (the recipe of scripts/gpu_real_client.sh): one run killed (kill -9 of
# every process) after the committed, sealed save at 200; then REPEATS rounds, each restarting
# once per MODES entry and once from storage, every restart to --train-iters 200 (the load,
# no training, no save) with --ckpt-keep-memory-snapshot, so the snapshot stays sealed for the
# next one. MODES (each an environment, docs/DEBUGGING.md; the restore is prepared in Megatron's
# initialisation unless MCX_PREPARE_RESTORE says otherwise):
#   early_device  MCX_RESTORE_SUMS=device: prepared in initialize_megatron, pinned only, summed
#                 on the device at the load
#   early_host    MCX_RESTORE_SUMS=host (the default since this session): prepared there,
#                 faulted in and summed on the host, pinned (since the thirty-first session
#                 with --ckpt-restore-prefetch off: no copy ahead)
#   early_default no switch, no flag: since the thirty-first session the copy ahead into
#                 torch's block where it fits beside the sealing run's peak (auto)
#   early_pinstep early_default with MCX_PIN_ADOPTED=step: the restored snapshot is not pinned
#                 as the load returns, beside the rest of Megatron's load_checkpoint, but by the
#                 staging's preparation after the first training step (none in these restarts);
#                 the default since the thirty-sixth session
#   early_pinload early_default with MCX_PIN_ADOPTED=load: pinned as the load returns (the
#                 default before the thirty-sixth session)
#   early_paced   early_default with MCX_PIN_PACE=0.25: that pinning paced (a quarter of the time;
#                 the default since the thirty-sixth session)
#   early_unpaced early_default with MCX_PIN_PACE=1: every buffer at once (before that session)
#   storage_save  storage (the comparator, appended to every round, runs without --save: nothing
#                 of ours runs in its first steps) with --save to another root: a storage load
#                 whose first steps prepare the staging, as a restart's do (with STEPS=N)
#   storage_t8    storage with --ckpt-load-threads 8 (the one-rank default before the thirty-
#                 eighth session; storage itself reads with the default, auto)
#   early_prefetch  early_host with --ckpt-restore-prefetch: copied to the device ahead too
#   early_prefetch_cached  early_prefetch with MCX_PREFETCH_BLOCK=cached (the block torch's,
#                 left in its cache at the release, not managed memory freed there)
#   build_host    MCX_PREPARE_RESTORE=build MCX_RESTORE_SUMS=host: the twenty-seventh session's
#                 way (prepared beside the model build)
#   build_device  MCX_PREPARE_RESTORE=build (pinned beside the build, summed on the device)
#   build_prefetch  MCX_PREPARE_RESTORE=build with --ckpt-restore-prefetch (the copy ahead
#                 beside the build, stopped when the load comes)
#   prep0         MCX_PREPARE_RESTORE=0 (nothing ahead: the load does everything)
#   storage       a copy of the same checkpoint, its pages read first, --no-ckpt-memory-restore
#                 (prepared as by default), run in every round
#   old_<MODE>    <MODE> with the package copied into .ab_old (carried; an A/B of two codes in
#                 one call: rm -rf .ab_old; mkdir .ab_old; git archive REV megatron_ckpt_ext |
#                 tar -x -C .ab_old), run with PYTHONSAFEPATH=1: torchrun's -m otherwise puts
#                 the working directory (this repository) first on sys.path, ahead of
#                 PYTHONPATH's .ab_old, and both arms ran this tree until the thirty-eighth
#                 session (docs/notes/node.md; the fix checked on CPU, not yet on a device)
# Per restart: Megatron's model-and-optimizer-setup and load-checkpoint timers, and the wall
# time from its "[before megatron-init]" to "[after model, optimizer ... built]" stamps (init_to_
# model_s: what an earlier preparation could lengthen instead).
# Prints one line per restart; writes $OUT/restart_repeat_$MODEL.jsonl and
# $OUT/restart_repeat_logs_$MODEL.tgz. STEPS=N: each restart trains N steps (their times in the
# line, step_ms: what a restore leaves to the first steps) and is then SIGKILLed. REST_PROBE=1: also the timers of Megatron-LM's
# load_checkpoint steps (rest_probe/sitecustomize.py) in $OUT/restart_repeat_rest_probe_$MODEL.jsonl.
#   OUT=$OUT MODEL=134m REPEATS=3 bash docs/megatron_lm/steps/restart_repeat_s28.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source scripts/mlm_recipe.sh
mlm_ready || exit 2
MODEL=${MODEL:-134m}; REPEATS=${REPEATS:-3}; MODES=${MODES:-early_device early_host build_host}
if [ "${REST_PROBE:-0}" = 1 ]; then  # rest_probe/: Megatron's load_checkpoint steps timed, a
  # line per load (the kill run's first, then the restarts in the order printed)
  export MCX_REST_PROBE="$OUT/restart_repeat_rest_probe_$MODEL.jsonl"
  export PYTHONPATH=$PWD/docs/megatron_lm/steps/rest_probe:$PYTHONPATH; : > "$MCX_REST_PROBE"
fi
mlm_model "$MODEL" || exit 2  # MARGS, EVERY
export CUDA_DEVICE_MAX_CONNECTIONS=1
W=/tmp/rr_$MODEL; K=$W/kill; L=/tmp/rr_logs_$MODEL; rm -rf "$W" "$L"; mkdir -p "$W" "$L"
BASE=("${COMMON[@]}" "${MARGS[@]}" "${OURS[@]}" --save-interval $EVERY --lr-decay-iters 1000
  --logging-level 20)
LINES="$OUT/restart_repeat_$MODEL.jsonl"; : > "$LINES"
python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1  # no seal of an earlier run waited for
# the kill: every process of the run, after the commit of 2 x EVERY and its seal
setsid python3 -m torch.distributed.run --nproc-per-node 1 -m megatron_ckpt_ext.launch \
  .mlm/pretrain_gpt.py "${BASE[@]}" --train-iters $((3 * EVERY + 50)) --save $K --load $K \
  > "$L/kill_$MODEL.log" 2>&1 &
pid=$!; t0=$(date +%s)
until [ "$(cat $K/latest_checkpointed_iteration.txt 2>/dev/null)" = $((2 * EVERY)) ]; do
  sleep 0.2; [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "no commit"; kill -9 -- -$pid
    tar -czf "$OUT/restart_repeat_logs_$MODEL.tgz" -C "$L" .; exit 1; }
done
until ls /dev/shm/mcxseal_*_0.json >/dev/null 2>&1; do sleep 0.1; done
sleep 0.5; kill -9 -- -$pid 2>/dev/null; pkill -9 -f -- "--save $K " ; wait $pid 2>/dev/null
sleep 1; echo "killed after the commit of $(cat $K/latest_checkpointed_iteration.txt) ($(( $(date +%s) - t0 )) s)"
mkdir -p $K.copy; cp $K/latest_checkpointed_iteration.txt $K.copy/
cp -r $K/iter_$(printf %07d $((2 * EVERY))) $K.copy/
cat $K.copy/iter_*/* > /dev/null  # its pages in the page cache: the warm comparator
one() {  # ROUND MODE
  local log="$L/${MODEL}_r$1_$2.log" envs=() args=(--load $K --save $K --ckpt-keep-memory-snapshot)
  local mode=$2 path=$PYTHONPATH
  local safe=""  # the old arm: no working directory (this repository) first on sys.path
  # (any non-empty PYTHONSAFEPATH turns it on, "0" too)
  case $mode in old_*) mode=${mode#old_}; path=$PWD/.ab_old:$PYTHONPATH; safe=1 ;; esac
  case $mode in
    early_device) envs=(MCX_RESTORE_SUMS=device) ;;
    early_host) envs=(MCX_RESTORE_SUMS=host) args+=(--ckpt-restore-prefetch off) ;;
    early_default) ;;
    early_pinstep) envs=(MCX_PIN_ADOPTED=step) ;;
    early_pinload) envs=(MCX_PIN_ADOPTED=load) ;;
    early_paced) envs=(MCX_PIN_PACE=0.25) ;;
    early_unpaced) envs=(MCX_PIN_PACE=1) ;;
    early_prefetch) envs=(MCX_RESTORE_SUMS=host) args+=(--ckpt-restore-prefetch) ;;
    early_prefetch_cached) envs=(MCX_RESTORE_SUMS=host MCX_PREFETCH_BLOCK=cached)
      args+=(--ckpt-restore-prefetch) ;;
    build_host) envs=(MCX_PREPARE_RESTORE=build MCX_RESTORE_SUMS=host) ;;
    build_device) envs=(MCX_PREPARE_RESTORE=build MCX_RESTORE_SUMS=device) ;;
    build_prefetch) envs=(MCX_PREPARE_RESTORE=build) args+=(--ckpt-restore-prefetch) ;;
    prep0) envs=(MCX_PREPARE_RESTORE=0) ;;
    storage) envs=(MCX_RESTORE_SUMS=device) args=(--load $K.copy --no-ckpt-memory-restore) ;;
    storage_save) args=(--load $K.copy --save $W/save_elsewhere --no-ckpt-memory-restore) ;;
    storage_t8) envs=(MCX_RESTORE_SUMS=device)
      args=(--load $K.copy --no-ckpt-memory-restore --ckpt-load-threads 8) ;;
  esac
  if [ "${STEPS:-0}" -gt 0 ]; then  # STEPS training steps, then SIGKILL (no end-of-training
    # save, so the same snapshot and copy serve every restart); their times in the line
    local last=$((2 * EVERY + STEPS)) t0=$(date +%s)
    env PYTHONPATH="$path" PYTHONSAFEPATH=$safe "${envs[@]}" setsid python3 -m torch.distributed.run \
      --nproc-per-node 1 \
      --master-port $((29500 + RANDOM % 1000)) -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py \
      "${BASE[@]}" "${RESUME[@]}" --train-iters $((last + 20)) --override-opt_param-scheduler \
      "${args[@]}" > "$log" 2>&1 &
    local pid=$!
    until grep -q "iteration *$((last + 1))/" "$log" 2>/dev/null; do
      sleep 0.2; kill -0 $pid 2>/dev/null || break; [ $(( $(date +%s) - t0 )) -gt 100 ] && break
    done
    kill -9 -- -$pid 2>/dev/null; pkill -9 -f -- "--save $K " ; wait $pid 2>/dev/null; sleep 1
  else
  env PYTHONPATH="$path" PYTHONSAFEPATH=$safe "${envs[@]}" timeout 100 python3 -m torch.distributed.run \
    --nproc-per-node 1 \
    --master-port $((29500 + RANDOM % 1000)) -m megatron_ckpt_ext.launch .mlm/pretrain_gpt.py \
    "${BASE[@]}" "${RESUME[@]}" --train-iters $((2 * EVERY)) --override-opt_param-scheduler \
    "${args[@]}" > "$log" 2>&1
  fi
  python3 - "$log" "$1" "$2" "$LINES" <<'PY'
import json, re, sys
log, rnd, mode, out = sys.argv[1:5]
text = open(log, errors="replace").read()
def timer(name):
    m = re.search(rf"{name} \.+: \(([0-9.]+), ([0-9.]+)\)", text)
    return round(float(m.group(2)) / 1000, 4) if m else None
rep = [json.loads(l.split("checkpoint load report: ", 1)[1]) for l in text.splitlines()
       if "checkpoint load report: " in l]
r = rep[-1] if rep else {}
def stamp(label):
    from datetime import datetime
    m = re.search(rf"\[{label}\] datetime: ([0-9-]+ [0-9:.]+)", text)
    return datetime.fromisoformat(m.group(1)) if m else None
a, b = stamp("before megatron-init"), stamp("after model, optimizer, and learning rate scheduler are built")
md = r.get("memory_detail", {})
row = {"round": int(rnd), "mode": mode, "setup_s": timer("model-and-optimizer-setup"),
       "load_s": timer("load-checkpoint"), "tier": r.get("tier"), "our_load_s": r.get("load_s"),
       "prepared_s": md.get("prepared_s"), "prepared_steps": md.get("prepared_steps"),
       "device_summed": md.get("device_summed"), "memory_steps": r.get("memory_steps"),
       "phases": r.get("phases"), "direct_issue_s": md.get("direct_issue_s"),
       "block": md.get("device_ahead_block"),
       "init_to_model_s": round((b - a).total_seconds(), 3) if a and b else None,
       "init_s": timer("startup-initialize-megatron"), "jit_s": timer("startup-set-jit-fusion-options"),
       "step_ms": [float(v) for v in re.findall(
           r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]}
if row["setup_s"] and row["load_s"]:
    row["build_s"] = round(row["setup_s"] - row["load_s"], 4)
open(out, "a").write(json.dumps(row) + "\n")
print(json.dumps({k: row[k] for k in ("round", "mode", "tier", "setup_s", "load_s", "prepared_s",
                                      "init_to_model_s", "init_s", "jit_s")}
                 | {"build_s": row.get("build_s"), "steps": row["prepared_steps"],
                    "block": row["block"], "step_ms": row["step_ms"][:4]}))
PY
}
for r in $(seq 1 "$REPEATS"); do  # the logs archived after each restart: a call cut by its
  for m in $MODES storage; do  # limit still returns them (a call returns at most 8 files)
    one "$r" "$m"; tar -czf "$OUT/restart_repeat_logs_$MODEL.tgz" -C "$L" .
  done
done
python3 - "$LINES" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for mode in dict.fromkeys(r["mode"] for r in rows):
    got = [r for r in rows if r["mode"] == mode and r["setup_s"]]
    if got:
        print(mode, "tiers", sorted({r["tier"] for r in got}),
              "setup median", statistics.median(r["setup_s"] for r in got),
              "load median", statistics.median(r["load_s"] for r in got), "init_to_model median",
              statistics.median(r["init_to_model_s"] or 0 for r in got), "n", len(got))
PY
rm -rf "$W"; python3 -m megatron_ckpt_ext shm clean >/dev/null 2>&1 || true
tar -czf "$OUT/restart_repeat_logs_$MODEL.tgz" -C "$L" . && rm -rf "$L"
