#!/usr/bin/env bash
# One GPU: where a rank's host memory above its staging goes. One rank, GIB GiB, persistent
# cpu-shm saves with the per-process and per-mapping breakdown (profile_save.py --mem-breakdown
# --mem-stages); then 8 ranks on the same GPU, ours only, the node's memory against its staged
# bytes (bench_ckpt.py). From the repository root on the GPU machine:
#   OUT=$OUT bash docs/node/steps/memory_split.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
GIB=${GIB:-2}
timeout -k 10 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  benchmarks/profile_save.py --gib "$GIB" --saves 5 --modes persistent_cpu_shm --mem-breakdown \
  --mem-stages --out "$OUT/profile_mem.json" > "$OUT/profile_mem.log" 2>&1
echo "profile rc=$?"; grep -E "mem |mappings of|^\s+\[|==" "$OUT/profile_mem.log" | cut -c1-400
timeout -k 10 300 python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-8}" \
  benchmarks/bench_ckpt.py --device cuda --ranks-per-device auto --gib-per-rank "$GIB" --saves 5 \
  --modes ours-async-persistent-cpu-shm --out /tmp/node_save --json "$OUT/node_save_ours.json" \
  > "$OUT/node_save_ours.log" 2>&1
echo "node save rc=$?"; tail -4 "$OUT/node_save_ours.log" | cut -c1-300
python3 - "$OUT/node_save_ours.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    pr = r.get("per_rank", {})
    print(r.get("mode", ""), r.get("save", ""), "node", r.get("host_extra_node_bytes"),
          "tree MB", [round(b / 1e6) for b in pr.get("host_extra_tree_bytes", [])])
for k, v in d["summary"]["targets"].items():
    if "host_node" in k: print(k, v)
PY
rm -rf /tmp/node_save
