#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm), in one call: the real client (134M, ours only) with the
# first save planned ahead switched off (MCX_PLAN_AHEAD=0: train + cold resume) and on (the
# default: train, cold resume, kill -9 of every process and the restart from memory); each
# run's save reports (plan_s, planned_ahead_s) printed from its logs.
# Results: docs/megatron_lm/real_client/h100_134m_1126h_plan_ahead_{0,1}.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
for v in 0 1; do
  echo "== MCX_PLAN_AHEAD=$v KILL=$v"
  MCX_PLAN_AHEAD=$v MODELS=134m SOURCES=ours KILL=$v RESUME_WARM=0 OUT=/tmp/ab$v WORK=/tmp/rcw$v \
    timeout 270 bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical'
  cp /tmp/ab$v/real_client.json "$R/h100_134m_1126h_plan_ahead_$v.json"
  cp /tmp/ab$v/logs.tgz "$R/h100_134m_1126h_plan_ahead_${v}_logs.tgz"
  rm -rf /tmp/rcw$v /tmp/x$v && mkdir -p /tmp/x$v && tar xzf /tmp/ab$v/logs.tgz -C /tmp/x$v
  for f in $(find /tmp/x$v -name "ours_134m_*_reports.jsonl" | sort); do
    echo "-- $f"
    python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if 'blocking_s' in r:
        print(r['iteration'], r['blocking_s'], 'plan', r['phases'].get('plan_s'),
              'ahead', r.get('stage_detail', {}).get('planned_ahead_s'))
" "$f"
  done
  grep -h "plan the first save\|structure changed" /tmp/x$v/logs/*.log | head -3
done
