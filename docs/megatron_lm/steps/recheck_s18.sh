#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): the real client at the eighteenth session's start (code
# after the one-rank load fix, 40e1e23), ours vs stock in one run, every row: train (first,
# steady, end of training), cold and warm resume, and ours killed after a committed save and
# restarted from memory (KILL=1) with the warm storage load of a copy. Results:
# docs/megatron_lm/real_client/<card>_134m_$LABEL.json (+ _logs.tgz); SOURCES=ours skips stock.
# Then, with LOAD8=1, the 8 GiB load benchmark (warm and cold, verifying and not). From the
# repository root:
#   OUT=$OUT [SOURCES=ours LABEL=s18b LOAD8=1] bash docs/megatron_lm/steps/recheck_s18.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
export MODELS=${MODELS:-134m} SOURCES=${SOURCES:-ours stock}
LABEL=${LABEL:-s18}
KILL=1 RESUME_COLD=1 RESUME_WARM=1 OUT=/tmp/run_s18 WORK=/tmp/rcw_s18 \
  timeout ${BUDGET:-560} bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc=\|Error\|error'
cp /tmp/run_s18/real_client.json "$OUT/${CARD}_${MODELS}_$LABEL.json"
cp /tmp/run_s18/logs.tgz "$OUT/${CARD}_${MODELS}_${LABEL}_logs.tgz"
mkdir -p /tmp/x_s18 && tar xzf /tmp/run_s18/logs.tgz -C /tmp/x_s18
source docs/megatron_lm/steps/_ab_run.sh
print_reports /tmp/x_s18
if [ "${LOAD8:-0}" = 1 ]; then
  timeout -k 10 ${LOAD_BUDGET:-200} python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/bench_load.py --gib 8 --repeats 2 --sources ours ours_no_verify \
    --out /tmp/load8_s18 --json "$OUT/${CARD}_load_8gib_$LABEL.json" > "$OUT/${CARD}_load_8gib_$LABEL.log" 2>&1
  echo "load 8 GiB rc=$?"; grep "bench_load\]" "$OUT/${CARD}_load_8gib_$LABEL.log" | cut -c1-160
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['floors']); print(d['targets'])" "$OUT/${CARD}_load_8gib_$LABEL.json"
fi
