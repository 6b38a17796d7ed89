#!/usr/bin/env bash
# A/B on one GPU (carry .whl .mlm), in one call. Ran at 57ce629 only: the deferral and its switch
# MCX_BACKGROUND_IN_LOAD were taken out after it (docs/notes/megatron_lm.md, twelfth session), so
# at any later commit both variants run the same code: the restart from memory of MODEL (134m or 1b;
# scripts/gpu_real_client.sh's kill run, ours only: kill -9 after the committed save at
# 2*SAVE_EVERY, relaunch, then the warm storage load of a copy of the same checkpoint) with the
# background work our load leaves started inside Megatron-LM's load_checkpoint
# (MCX_BACKGROUND_IN_LOAD=1, as before) and after it (the default), VARIANTS in that order.
# Prints, per run: Megatron's load-checkpoint timer from memory and from storage, our load's
# load_s, the first iterations after the restart and the first save after it.
# Results: $OUT/<card>_<model>_<LABEL>_<variant><n>.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
MODEL=${MODEL:-134m}
LABEL=${LABEL:-1130e}
VARIANTS=${VARIANTS:-"after inside after inside"}
n=0
for v in $VARIANTS; do
  n=$((n + 1))
  case $v in inside) export MCX_BACKGROUND_IN_LOAD=1 ;; after) unset MCX_BACKGROUND_IN_LOAD ;; esac
  name=${CARD}_${MODEL}_${LABEL}_$v$n
  echo "== $name $(date +%T)"
  MODELS=$MODEL SOURCES=none KILL=1 RESUME_COLD=0 RESUME_WARM=0 OUT=/tmp/ab_$n WORK=/tmp/rcw_$n \
    timeout ${RUN_TIMEOUT:-300} bash scripts/gpu_real_client.sh 2>&1 | grep '"load"\|identical\|rc='
  cp /tmp/ab_$n/real_client.json "$OUT/$name.json"
  cp /tmp/ab_$n/logs.tgz "$OUT/${name}_logs.tgz"
  rm -rf /tmp/rcw_$n /tmp/x_$n && mkdir -p /tmp/x_$n && tar xzf /tmp/ab_$n/logs.tgz -C /tmp/x_$n
  grep -h "load-checkpoint " /tmp/x_$n/logs/*restart*.log
  grep -h "checkpoint load report" /tmp/x_$n/logs/*restart.log | grep -o '"load_s": [0-9.]*'
  grep -h "elapsed time per iteration" /tmp/x_$n/logs/*_restart.log | head -3 \
    | grep -o "iteration *[0-9]*/\|per iteration (ms): [0-9.]*" | paste -sd' '
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print([(r["save"], r["iteration"], r["stall_s"]) for r in d["runs"] if r.get("run", "").endswith("restart")])
print([(r["kind"], r["load_s"], r["tier"]) for r in d["loads"] if r["kind"] != "kill"])
PY
done
