#!/usr/bin/env bash
# A/B on one GPU (carry .whl .mlm .abold), in one call: the real client (134M, saves every 50,
# KILL=0, cold resume) at 870d500 (old: .abold holds `git archive 870d500 megatron_ckpt_ext
# benchmarks scripts`, run from there) and at this commit (new: the world-of-one collectives
# skipped, the copies ahead issued before their signatures, the storage read's host chunks made as
# asked), then stock alone. Results: docs/megatron_lm/real_client/h100_134m_1128a_{old,new,stock}.json
# and _logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site
R=${OUT:?}
ROOT=$PWD
ln -sfn "$ROOT/.mlm" "$ROOT/.abold/.mlm"
source docs/megatron_lm/steps/_ab_run.sh
python3 -m megatron_ckpt_ext doctor 2>&1 | grep -i "crc"
for v in old new; do
  if [ $v = old ]; then cd "$ROOT/.abold"; else cd "$ROOT"; fi
  ab_run "$v" ours 240 h100_134m_1128a
done
cd "$ROOT"
ab_run stock stock 200 h100_134m_1128a
for v in old new stock; do
  print_table "$R/h100_134m_1128a_$v.json" "$v"
done
