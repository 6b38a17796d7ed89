#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm), in one call: the real client (134M, ours only, saves every
# 50) with the copies issued once Megatron has built its state dict (MCX_STAGE_AHEAD=0, as
# before) and issued on entry to Megatron's save_checkpoint, while it builds it (the default,
# save/ahead.py); the second run also kills every process after a committed save and relaunches
# (KILL=1: the restart from memory). Each run's save reports printed from its logs.
# Results: docs/megatron_lm/real_client/h100_134m_1126p_ahead_{off,on}.json and _logs.tgz (run p:
# the first call stopped the on-run at its old 280 s limit, so it was rerun with KILL=1 alone on
# the same machine: `KILL=1 ab_run on ours 480 h100_134m_1126p_ahead` after sourcing _ab_run.sh)
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
source docs/megatron_lm/steps/_ab_run.sh
for v in off on; do
  case $v in
    off) export MCX_STAGE_AHEAD=0 KILL=0; limit=200 ;;
    on) unset MCX_STAGE_AHEAD; export KILL=1; limit=380 ;;  # the kill run and restart: ~280 s
  esac
  ab_run $v ours $limit h100_134m_1126p_ahead
done
for v in off on; do
  python3 - "$R/h100_134m_1126p_ahead_$v.json" "$v" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("==", sys.argv[2], "floors", d.get("floors"))
for row in d["table"]:
    print(row)
for run in d["per_run"]:
    lr = run.get("load_report") or {}
    if lr.get("tier") == "memory":
        print("restore", lr.get("phases"), lr.get("memory_steps"), lr.get("memory_detail"))
PY
done
