#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): the restart from memory with the snapshot copied to the
# device while the model is built (load/device_ahead.py). First the memory tier's GPU tests
# (the prepared restart with and without --ckpt-restore-prefetch), then the real client:
# MODELS (default 1b) ours: train (the uninterrupted run), kill -9 of every process after a committed save, relaunch, and the
# warm storage load of the same checkpoint; losses compared with the uninterrupted run.
# Results: $OUT/<card>_<model>_$LABEL.json (+ _logs.tgz), $OUT/gpu_tests_$LABEL/.
# Runs 1127c-e ran while the copy ahead was the default (its three designs: after pinning each
# buffer, then through the bounce pool with pinning after, then without); it is now off by
# default: OURS_ARGS=--ckpt-restore-prefetch (the default here) turns it on for our runs.
export OURS_ARGS=${OURS_ARGS---ckpt-restore-prefetch}
set -uo pipefail
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/.site
LABEL=${LABEL:-1127c}; MODELS=${MODELS:-1b}
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
OUT=$OUT/gpu_tests_$LABEL timeout 150 bash scripts/gpu_tests.sh -k "prepared" 2>&1 | tail -4
for m in $MODELS; do
  MODELS=$m SOURCES=ours KILL=1 RESUME_COLD=0 RESUME_WARM=0 OUT=/tmp/run_${LABEL}_$m WORK=/tmp/rcw_${LABEL}_$m \
    timeout ${RUN_TIMEOUT:-430} bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc='
  cp /tmp/run_${LABEL}_$m/real_client.json "$OUT/${CARD}_${m}_$LABEL.json"
  cp /tmp/run_${LABEL}_$m/logs.tgz "$OUT/${CARD}_${m}_${LABEL}_logs.tgz"
  mkdir -p /tmp/x_${LABEL}_$m && tar xzf /tmp/run_${LABEL}_$m/logs.tgz -C /tmp/x_${LABEL}_$m
  grep -h "checkpoint load report" /tmp/x_${LABEL}_$m/logs/*restart*.log | cut -c1-1200
  grep -h "load-checkpoint \|after model, optimizer" /tmp/x_${LABEL}_$m/logs/*restart*.log
done
