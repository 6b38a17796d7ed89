#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm .ab), in one call: the real client (134M, saves every 50)
# with a steady save's staging after its directory opens (.ab/before/{checkpointer,steps}.py =
# megatron_ckpt_ext/checkpointer.py and save/steps.py before 1126k's stage-first commit) and
# before it (.ab/after/ = the same files after); stock beside the second (SOURCES). Each run's
# save reports (blocking, phases) printed from its logs.
# Results: docs/megatron_lm/real_client/h100_134m_1126k_stage_first_{before,after}.json, _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
for v in before after; do
  cp .ab/$v/checkpointer.py megatron_ckpt_ext/checkpointer.py
  cp .ab/$v/steps.py megatron_ckpt_ext/save/steps.py
  case $v in before) SRC=ours ;; after) SRC=${SOURCES:-ours stock} ;; esac
  echo "== $v ($SRC) $(date +%T)"
  MODELS=134m SOURCES="$SRC" KILL=0 RESUME_WARM=0 SAVE_EVERY_134M=50 OUT=/tmp/ab_$v WORK=/tmp/rcw_$v \
    timeout 300 bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc='
  cp /tmp/ab_$v/real_client.json "$R/h100_134m_1126k_stage_first_$v.json"
  cp /tmp/ab_$v/logs.tgz "$R/h100_134m_1126k_stage_first_${v}_logs.tgz"
  rm -rf /tmp/rcw_$v /tmp/x_$v && mkdir -p /tmp/x_$v && tar xzf /tmp/ab_$v/logs.tgz -C /tmp/x_$v
  for f in $(find /tmp/x_$v -name "ours_134m_*_reports.jsonl" | sort); do
    echo "-- $(basename "$f")"
    python3 - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "blocking_s" in r:
        p = {k.removesuffix("_s"): round(v * 1e3, 1) for k, v in r["phases"].items() if v}
        print(r["iteration"], "blocking_ms", round(r["blocking_s"] * 1e3, 1), p)
PY
  done
done
cp .ab/after/checkpointer.py megatron_ckpt_ext/checkpointer.py
cp .ab/after/steps.py megatron_ckpt_ext/save/steps.py
