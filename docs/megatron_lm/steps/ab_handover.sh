#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm), in one call: the real client (134M, saves every 50) with the
# persistent writer's request pickled in full at every save (MCX_RESEND_EACH_SAVE=1, as before
# save/handover.py) and with the write items and staged tensors kept in the writer (the default);
# stock in the second run's call too (SOURCES). Each run's save reports printed from its logs:
# blocking, the phases and copy_queue_wait_s.
# Results: docs/megatron_lm/real_client/h100_134m_1126k_handover_{resend,keep}.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
for v in resend keep; do
  case $v in resend) export MCX_RESEND_EACH_SAVE=1; SRC=ours ;;
             keep) unset MCX_RESEND_EACH_SAVE; SRC=${SOURCES:-ours stock} ;; esac
  echo "== $v ($SRC) $(date +%T)"
  MODELS=134m SOURCES="$SRC" KILL=0 RESUME_WARM=0 SAVE_EVERY_134M=50 OUT=/tmp/ab_$v WORK=/tmp/rcw_$v \
    timeout 280 bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc='
  cp /tmp/ab_$v/real_client.json "$R/h100_134m_1126k_handover_$v.json"
  cp /tmp/ab_$v/logs.tgz "$R/h100_134m_1126k_handover_${v}_logs.tgz"
  rm -rf /tmp/rcw_$v /tmp/x_$v && mkdir -p /tmp/x_$v && tar xzf /tmp/ab_$v/logs.tgz -C /tmp/x_$v
  for f in $(find /tmp/x_$v -name "ours_134m_*_reports.jsonl" | sort); do
    echo "-- $(basename "$f")"
    python3 - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "blocking_s" in r:
        p = {k.removesuffix("_s"): round(v * 1e3, 1) for k, v in r["phases"].items() if v}
        q = r.get("stage_detail", {}).get("copy_queue_wait_s")
        print(r["iteration"], "blocking_ms", round(r["blocking_s"] * 1e3, 1), p, "queue_wait_ms",
              None if q is None else round(q * 1e3, 2))
PY
  done
done
