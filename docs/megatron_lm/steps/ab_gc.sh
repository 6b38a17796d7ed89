#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm), in one call: the real client (134M, ours only, saves every
# 50) with Python's cyclic collector running inside save() (MCX_GC_IN_SAVE=1, as before) and
# paused while save() blocks (the default). Each run's save reports printed from its logs:
# blocking, the phases and the collector's pauses inside the save (gc_pause_s, collections).
# Results: docs/megatron_lm/real_client/h100_134m_1126n_gc_{in_save,paused}.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
for v in in_save paused; do
  case $v in in_save) export MCX_GC_IN_SAVE=1 ;; paused) unset MCX_GC_IN_SAVE ;; esac
  echo "== $v $(date +%T)"
  MODELS=134m SOURCES=ours KILL=0 RESUME_WARM=0 SAVE_EVERY_134M=50 OUT=/tmp/ab_$v WORK=/tmp/rcw_$v \
    timeout 250 bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|rc='
  cp /tmp/ab_$v/real_client.json "$R/h100_134m_1126n_gc_$v.json"
  cp /tmp/ab_$v/logs.tgz "$R/h100_134m_1126n_gc_${v}_logs.tgz"
  rm -rf /tmp/rcw_$v /tmp/x_$v && mkdir -p /tmp/x_$v && tar xzf /tmp/ab_$v/logs.tgz -C /tmp/x_$v
  for f in $(find /tmp/x_$v -name "ours_134m_*_reports.jsonl" | sort); do
    echo "-- $(basename "$f")"
    python3 - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "blocking_s" in r:
        p = {k.removesuffix("_s"): round(v * 1e3, 1) for k, v in r["phases"].items() if v}
        d = r.get("stage_detail", {})
        print(r["iteration"], "blocking_ms", round(r["blocking_s"] * 1e3, 1), p,
              "gc_ms", round(d.get("gc_pause_s", 0) * 1e3, 2), d.get("gc_collections", 0))
PY
  done
done
