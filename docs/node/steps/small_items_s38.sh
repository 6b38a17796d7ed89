#!/usr/bin/env bash
# One call on one GPU (carry .whl): the warm load of a state shaped like Megatron-LM's 134M one
# (bench_load's synthetic GPT at 2 GiB: hidden 1024, 8 layers, 396 items of 0.1-200 MB, against
# the real client's 400 items in 1.88 GB) at one rank with 2, 4, 8 and 16 reading threads,
# verifying and not, two repeats each after the process's first load: does the read step of a
# state of many small items stop scaling with threads (the real client's read step moved 10 GB/s
# and lost at 16 threads, where 8 GiB of 17 MB items gained)? Results under $OUT:
# <card>_1rank_2gib_load_threads.json/.log. From the repository root:
#   OUT=$OUT bash docs/node/steps/small_items_s38.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
NAME=${CARD}_1rank_2gib_load_threads
timeout -k 10 ${STEP_TIMEOUT:-240} python3 -m torch.distributed.run --standalone \
  --nproc-per-node 1 benchmarks/bench_load.py --gib 2 --repeats 2 --caches warm \
  --sources ours ours_no_verify --load-threads ${THREADS:-8 2 4 16} \
  --out /tmp/small_items --json "$OUT/$NAME.json" > "$OUT/$NAME.log" 2>&1
echo "rc=$?"; grep "bench_load\]\|Error" "$OUT/$NAME.log" | tail -18
python3 - "$OUT/$NAME.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["floors"])
for r in d["runs"]:
    p = r["phases"]
    print(r["variant"], r["load_threads"], r["load_s"], "read", round(p["read_s"] + p["h2d_s"], 3),
          "other", round(p["other_s"] + p["metadata_s"] + p["locate_s"], 3), r["read_detail"])
PY
rm -rf /tmp/small_items
