# Sourced by the ab_*.sh scripts here: ab_run NAME SOURCES TIMEOUT PREFIX runs the real client
# (134M, saves every 50, KILL=0 unless the caller sets it, RESUME_WARM=0) with the caller's environment, copies its JSON
# and logs to $R/PREFIX_NAME.json and _logs.tgz, and prints each of our runs' save reports:
# blocking, the phases, and where present copy_queue_wait_s and the collector's pauses.
# print_reports DIR: those reports, from the logs unpacked under DIR; print_table FILE LABEL: a
# real_client.json's floors and table.
ab_run() {
  local v=$1 src=$2 limit=$3 prefix=$4
  echo "== $v ($src) $(date +%T)"
  MODELS=134m SOURCES="$src" KILL=${KILL:-0} RESUME_WARM=0 SAVE_EVERY_134M=50 OUT=/tmp/ab_$v WORK=/tmp/rcw_$v \
    timeout "$limit" bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc='
  cp /tmp/ab_$v/real_client.json "$R/${prefix}_$v.json"
  cp /tmp/ab_$v/logs.tgz "$R/${prefix}_${v}_logs.tgz"
  rm -rf /tmp/rcw_$v /tmp/x_$v && mkdir -p /tmp/x_$v && tar xzf /tmp/ab_$v/logs.tgz -C /tmp/x_$v
  print_reports /tmp/x_$v
}

print_reports() {
  local f
  for f in $(find $1 -name "ours_134m_*reports.jsonl" | sort); do
    echo "-- $(basename "$f")"
    python3 - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "blocking_s" in r:
        p = {k.removesuffix("_s"): round(v * 1e3, 1) for k, v in r["phases"].items() if v}
        d = r.get("stage_detail", {})
        extra = {k: d[k] for k in ("copy_queue_wait_s", "gc_pause_s", "gc_collections", "staged_ahead_s",
                                   "plan")
                 if k in d}
        print(r["iteration"], "blocking_ms", round(r["blocking_s"] * 1e3, 1), p, extra)
PY
  done
}

print_table() {
  python3 - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("==", sys.argv[2], "floors", d.get("floors"))
for row in d["table"]:
    print(row)
PY
}
