#!/usr/bin/env bash
# A/B on one GPU (carry .whl .mlm), in one call: the real client (134M, ours only, saves every
# 50, KILL=0) with every steady save planned in full by megatron-core (MCX_REPLAY_PLAN=0, as
# before) and with steady saves replaying the request planned for the same structure (the
# default, backend/replay.py). Each run's save reports printed from its logs (the report's
# stage_detail.plan says which path each save took). STOCK=1 runs stock Megatron-LM alone (the
# same recipe), for the same-machine baseline in a second call.
# Results: docs/megatron_lm/real_client/h100_134m_1126r_replay_{off,on}.json and _logs.tgz,
# h100_134m_1126r_stock.json.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
source docs/megatron_lm/steps/_ab_run.sh
python3 -m megatron_ckpt_ext doctor 2>&1 | grep -i "crc"
if [ "${STOCK:-0}" = 1 ]; then
  ab_run stock stock 300 h100_134m_1126r
  exit 0
fi
for v in off on; do
  case $v in
    off) export MCX_REPLAY_PLAN=0 ;;
    on) unset MCX_REPLAY_PLAN ;;
  esac
  ab_run "replay_$v" ours 240 h100_134m_1126r
done
for v in off on; do
  print_table "$R/h100_134m_1126r_replay_$v.json" "$v"
done
