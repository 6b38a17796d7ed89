#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): where a restart's load-checkpoint time goes. The MODEL
# (134m, the default, or 1b) kill run of scripts/gpu_real_client.sh (ours only: train to the committed save at 200, kill -9
# every process, relaunch: the restore from memory; then the warm storage load of a copy of the
# same checkpoint), with MCX_PROFILE_LOADS: Megatron's load_checkpoint under cProfile in each run
# (in order: the kill run's, which finds no checkpoint; the restart's; the storage load's).
# cProfile slows Python-heavy code: the times here split a load, they do not time it; and on
# Python 3.12 it follows every thread. REST_PROBE=1 instead (no cProfile): rest_probe/'s timers
# of megatron-core's steps inside the restore's load of the rest, and of Megatron-LM's
# load_checkpoint steps, on the loading thread ($OUT/<card>_<model>_${LABEL}_rest_probe.jsonl).
# Results: $OUT/<card>_<model>_$LABEL.json (+ _logs.tgz), $OUT/<card>_<model>_${LABEL}_load_profile.txt.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/megatron_lm/steps/_prologue.sh
LABEL=${LABEL:-1129a}
MODEL=${MODEL:-134m}
rm -rf /tmp/prof_$LABEL; mkdir -p /tmp/prof_$LABEL
if [ "${REST_PROBE:-0}" = 1 ]; then
  export MCX_REST_PROBE=/tmp/prof_$LABEL/rest_probe.jsonl
  export PYTHONPATH=$PWD/docs/megatron_lm/steps/rest_probe:$PYTHONPATH
else
  export MCX_PROFILE_LOADS=/tmp/prof_$LABEL
fi
MODELS=$MODEL SOURCES=none KILL=1 RESUME_COLD=0 RESUME_WARM=0 \
  OUT=/tmp/run_$LABEL WORK=/tmp/rcw_$LABEL timeout ${RUN_TIMEOUT:-300} bash scripts/gpu_real_client.sh 2>&1 \
  | grep '"load"\|identical\|rc='
cp /tmp/run_$LABEL/real_client.json "$OUT/${CARD}_${MODEL}_$LABEL.json"
cp /tmp/run_$LABEL/logs.tgz "$OUT/${CARD}_${MODEL}_${LABEL}_logs.tgz"
cp /tmp/prof_$LABEL/load_profile_rank0.txt "$OUT/${CARD}_${MODEL}_${LABEL}_load_profile.txt" 2>/dev/null
cp /tmp/prof_$LABEL/rest_probe.jsonl "$OUT/${CARD}_${MODEL}_${LABEL}_rest_probe.jsonl" 2>/dev/null
cat /tmp/prof_$LABEL/rest_probe.jsonl 2>/dev/null
mkdir -p /tmp/x_$LABEL && tar xzf /tmp/run_$LABEL/logs.tgz -C /tmp/x_$LABEL
grep -h "checkpoint load report" /tmp/x_$LABEL/logs/*restart*.log | cut -c1-1500
grep -h "load-checkpoint \|after model, optimizer" /tmp/x_$LABEL/logs/*restart*.log
