#!/usr/bin/env bash
# A/B on one H100 (carry .whl .mlm .ab): the real client's restart from memory (134M, ours only,
# KILL=1) with the package as it is ("after": the snapshot mapped, summed and pinned while the
# model is built) and with .ab/before/megatron_ckpt_ext (git archive 9600d55 megatron_ckpt_ext
# benchmarks: the bounce pool alone built ahead), in one call; then the 8 GiB synthetic restore
# (after). Results: docs/megatron_lm/real_client/h100_134m_1126g_prepared_ab.tgz, docs/notes/memory.md
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=${OUT:?}
mv megatron_ckpt_ext .ab/after_pkg
for v in ${VARIANTS:-after before}; do
  rm -rf megatron_ckpt_ext
  if [ "$v" = before ]; then cp -r .ab/before/megatron_ckpt_ext .; else cp -r .ab/after_pkg megatron_ckpt_ext; fi
  echo "== $v $(date +%T)"
  mkdir -p "$R/$v"
  OUT=$R/$v MODELS=134m SOURCES=ours KILL=1 RESUME_WARM=0 timeout 280 bash scripts/gpu_real_client.sh 2>&1 | tail -12
done
rm -rf megatron_ckpt_ext && cp -r .ab/after_pkg megatron_ckpt_ext
[ "${SYNTH:-1}" = 1 ] && timeout 150 python3 benchmarks/bench_memory_restore.py --gib 8 --saves 2 --repeats 2 \
  --cases ours-memory ours-storage-warm --out /tmp/mr --json "$R/synthetic_8gib.json" 2>&1 | grep "^\[restore\]" | cut -c1-700
cd "$R" && tar czf prepared_ab.tgz after before synthetic_8gib.json 2>/dev/null; rm -rf after before synthetic_8gib.json
