#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): the real client at the session's last commit, ours vs
# stock in the same run (134M, saves every 100, so the end-of-training save at 350 is made;
# KILL=0, RESUME_WARM=0). Results: docs/megatron_lm/real_client/<card>_134m_$LABEL.json (+ _logs.tgz);
# run s (LABEL=1126s) at dbd96cc, run t (LABEL=1126t) with the first save replaying prepare()'s plan;
# run 1127f with KILL=1 (ours also killed after a committed save and restarted from memory).
set -uo pipefail
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/.site
LABEL=${LABEL:-1126s}
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
python3 -m megatron_ckpt_ext doctor 2>&1 | grep -i crc
MODELS=134m KILL=${KILL:-0} RESUME_WARM=0 OUT=/tmp/run_$LABEL WORK=/tmp/rcw_$LABEL timeout 560 bash scripts/gpu_real_client.sh 2>&1 \
  | grep '"save"\|"load"\|identical\|rc='
cp /tmp/run_$LABEL/real_client.json "$OUT/${CARD}_134m_$LABEL.json"
cp /tmp/run_$LABEL/logs.tgz "$OUT/${CARD}_134m_${LABEL}_logs.tgz"
mkdir -p /tmp/x_$LABEL && tar xzf /tmp/run_$LABEL/logs.tgz -C /tmp/x_$LABEL
source docs/megatron_lm/steps/_ab_run.sh
print_reports /tmp/x_$LABEL
