#!/usr/bin/env bash
# One call on one H100 (carry .whl .mlm): where a steady save's planning goes on the GPU host
# (benchmarks/plan_cost.py --breakdown, replay on vs MCX_REPLAY_PLAN=0, CPU and CUDA tensors), the
# real client with replay on under MCX_PROFILE_SAVES (cProfile of each save), and stock Megatron-LM
# alone on the same machine. Results (the card's name first; run r's call ran on an H200):
# docs/megatron_lm/plan_cost_h200{host_cpu,_cuda}_mcore0192_replay.json,
# real_client/h200_134m_1126r_{replay_on_prof,stock}.json (+ _logs.tgz),
# profiles/h200_134m_1126r_replay_on_save_profile.txt.
set -uo pipefail
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl; export PYTHONPATH=$PWD:$PWD/.site
R=$OUT
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
echo "== plan_cost (host CPU, mcore 0.19.2)"
python3 benchmarks/plan_cost.py --saves 14 --baseline-switch MCX_REPLAY_PLAN=0 --breakdown --json $R/plan_cost_${CARD}host_cpu_mcore0192_replay.json 2>&1 | grep -v -i "warn\|pynvml"
echo "== plan_cost (cuda tensors)"
python3 benchmarks/plan_cost.py --saves 14 --device cuda --hidden 256 --baseline-switch MCX_REPLAY_PLAN=0 --breakdown --json $R/plan_cost_${CARD}_cuda_mcore0192_replay.json 2>&1 | grep -v -i "warn\|pynvml"
source docs/megatron_lm/steps/_ab_run.sh
mkdir -p $R/prof
MCX_PROFILE_SAVES=$R/prof ab_run replay_on_prof ours 200 ${CARD}_134m_1126r 2>&1 | tail -12
ab_run stock stock 300 ${CARD}_134m_1126r 2>&1 | tail -3
print_table "$R/${CARD}_134m_1126r_stock.json" stock
