#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm .ab), in one call: the real client (134M, ours only, saves
# every 50) with the stage's device-to-host copies issued one `torch.cuda.stream` context per
# tensor (.ab/copies_before.py = megatron_ckpt_ext/staging/copies.py before 1126k) and once per
# device through torch._foreach_copy_ (.ab/copies_after.py = the same file after); each run's
# save reports (blocking, phases) printed from its logs. The CUDA staging tests run first.
# Results: docs/megatron_lm/real_client/h100_134m_1126k_copies_{before,after}.json and _logs.tgz
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
for v in before after; do
  cp .ab/copies_$v.py megatron_ckpt_ext/staging/copies.py
  echo "== $v $(date +%T)"
  MODELS=134m SOURCES=ours KILL=0 RESUME_WARM=0 SAVE_EVERY_134M=50 OUT=/tmp/ab_$v WORK=/tmp/rcw_$v \
    timeout 250 bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|rc='
  cp /tmp/ab_$v/real_client.json "$R/h100_134m_1126k_copies_$v.json"
  cp /tmp/ab_$v/logs.tgz "$R/h100_134m_1126k_copies_${v}_logs.tgz"
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
cp .ab/copies_after.py megatron_ckpt_ext/staging/copies.py
