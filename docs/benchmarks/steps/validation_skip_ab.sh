#!/usr/bin/env bash
# One GPU (carry .whl .mlm .ab_old), one call: (1) 8 GiB warm loads, the storage load with
# megatron-core's sharding validation inside it (old: 374df86^'s package and benchmarks copied
# into $OLD) and without it (this tree), alternated, each beside the same load without
# verification; (2) the 134M real client's restart from memory: our train run, kill -9 after the
# committed save at 200, relaunch, the warm storage load of a copy, losses compared with train's.
# From the repository root on the GPU machine:
#   OLD=.ab_old OUT=$OUT bash docs/benchmarks/steps/validation_skip_ab.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
source docs/benchmarks/steps/_load_runs.sh
REPEATS=${REPEATS:-2} load_runs ${ORDER:-old new old new}
MODELS=134m SOURCES=ours KILL=1 RESUME_COLD=0 RESUME_WARM=0 RUN_TIMEOUT=150 \
  OUT=/tmp/rc_kill timeout 300 bash scripts/gpu_real_client.sh 2>&1 | grep '"save"\|"load"\|identical\|rc='
cp /tmp/rc_kill/real_client.json "$OUT/${CARD}_134m_kill_s16.json"
cp /tmp/rc_kill/logs.tgz "$OUT/${CARD}_134m_kill_s16_logs.tgz"
