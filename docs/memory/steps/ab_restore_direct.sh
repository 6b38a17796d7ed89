#!/usr/bin/env bash
# A/B run on one H100 (carry .whl .mlm .ab): .ab/retained_before.py = megatron_ckpt_ext/staging/retained.py
#   at ed43f48; .ab/retained_direct.py = the same with the bounced branch of copy_verified's run() replaced
#   by: _populate(src piece); crc of the piece; dst piece .copy_(src piece) (pageable, synchronous).
#   Results: docs/memory/steps/h100_ab_restore_direct.tgz, docs/notes/memory.md
# A/B of the restore's copy: bounce (current) vs direct pageable copies (variant), 8 GiB, ours-memory
set -uo pipefail
cd "$(dirname "$0")/.."
R=${OUT:?}
for v in ${VARIANTS:-before direct before direct}; do
  cp .ab/retained_$v.py megatron_ckpt_ext/staging/retained.py
  echo "== $v $(date +%T)"
  timeout 200 python3 benchmarks/bench_memory_restore.py --gib 8 --saves 2 --repeats 2 --cases ours-memory \
    --out /tmp/mr --json $R/$v-$RANDOM.json 2>&1 | grep "^\[restore\]" | cut -c1-400
done
cp .ab/retained_before.py megatron_ckpt_ext/staging/retained.py
cd "$R" && tar czf ab_restore.tgz *.json && rm -f *.json
