#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): where the end-of-training save of a resumed run spends
# Megatron's save-checkpoint timer beyond our blocking time (runs s and t: 2.1x steady).
# Ours only, 134M, saves every 100 (train to 350, resume cold to 450), with MCX_WRITER_TRACE:
# Megatron's whole save_checkpoint per save (staging ahead, body, device wait after) and every
# collector pass of 1 ms or more in the trainer. Results: $OUT/<card>_134m_$LABEL.json, _logs.tgz,
# _trace.jsonl; the table printed below. Run 1127a at 48fb0ca (before the seal is cancelled, not
# waited for), 1127b after it with PROFILE=1.
set -uo pipefail
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/.site
LABEL=${LABEL:-1127a}
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
export MCX_WRITER_TRACE=/tmp/trace_$LABEL
rm -rf "$MCX_WRITER_TRACE"
# PROFILE=1: also every save under cProfile (Megatron's whole save_checkpoint) and torch's CUDA
# sync debug mode (where a save waited for the device): $OUT/<card>_134m_$LABEL_{profile,sync}/
if [ "${PROFILE:-0}" = 1 ]; then
  export MCX_PROFILE_SAVES=$OUT/${CARD}_134m_${LABEL}_profile MCX_SYNC_POINTS=$OUT/${CARD}_134m_${LABEL}_sync
fi
MODELS=134m SOURCES=ours KILL=0 RESUME_WARM=0 OUT=/tmp/run_$LABEL WORK=/tmp/rcw_$LABEL \
  timeout 400 bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc='
cp /tmp/run_$LABEL/real_client.json "$OUT/${CARD}_134m_$LABEL.json"
cp /tmp/run_$LABEL/logs.tgz "$OUT/${CARD}_134m_${LABEL}_logs.tgz"
cp "$MCX_WRITER_TRACE/writer_trace.jsonl" "$OUT/${CARD}_134m_${LABEL}_trace.jsonl"
mkdir -p /tmp/x_$LABEL && tar xzf /tmp/run_$LABEL/logs.tgz -C /tmp/x_$LABEL
source docs/megatron_lm/steps/_ab_run.sh
print_reports /tmp/x_$LABEL
python3 - "$MCX_WRITER_TRACE/writer_trace.jsonl" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
t0 = min(e.get("start", e["end"]) for e in ev)
for e in sorted(ev, key=lambda e: e.get("start", e["end"])):
    if e["what"] in ("save_checkpoint", "gc", "scheduled", "committed"):
        keep = {k: e[k] for k in ("pid", "iteration", "s", "ahead_s", "body_s", "sync_after_s",
                                  "generation", "collected") if k in e}
        print(f'{e.get("start", e["end"]) - t0:9.3f} {e["what"]:16s} {keep}')
PY
