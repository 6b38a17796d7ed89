#!/usr/bin/env bash
# One call on one GPU (carry .whl .mlm): where a prepared restore from memory sums its buffers.
# The real client, ours only, the kill run alone (kill -9 after the committed save at 2 x the
# save interval, the relaunch, the warm storage load of a copy of the same checkpoint), once per
# MCX_RESTORE_SUMS value in ORDER (docs/DEBUGGING.md: device = pin only beside the model build,
# sum the copies on the device; host = fault in and sum on 16 host threads beside the build),
# and PREP0=1 adds a run with MCX_PREPARE_RESTORE=0 (nothing beside the build); device_hostsum
# in ORDER is device with MCX_DEVICE_CRC_TRITON=0 (pinned beside the build, summed on the host's
# copy threads at the load). First the device CRC's kernel is compiled once into Triton's cache
# (as on a node that has loaded a checkpoint before), timed, then timed again from the cache.
# Per run:
# Megatron's model-and-optimizer-setup and load-checkpoint timers (build = setup - load).
# Then the build stand-in beside the preparation on a fresh mapping (PROBE=1).
#   OUT=$OUT MODEL=134m bash docs/megatron_lm/steps/restore_sums_ab_s28.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
MODEL=${MODEL:-134m}
run_one() {  # NAME, then environment assignments
  local name=$1; shift
  env "$@" MODELS=$MODEL SOURCES=none KILL=1 RESUME_COLD=0 RESUME_WARM=0 OUT=/tmp/run_$name \
    WORK=/tmp/rcw_$name timeout ${BUDGET:-200} bash scripts/gpu_real_client.sh \
    > "$OUT/${CARD}_${MODEL}_sums_$name.txt" 2>&1
  collect_run /tmp/run_$name "${CARD}_${MODEL}_sums_$name"
  rm -rf /tmp/rcw_$name
  for f in /tmp/run_$name/logs/*restart*.log; do
    echo "$name $(basename "$f" .log): $(grep -h 'model-and-optimizer-setup\|load-checkpoint' "$f" \
      | awk '{print $1, $3}' | tr '\n' ' ')"
    grep -ho '"memory_steps": {[^}]*}' "$f" | head -1
    grep -ho '"prepared_s": [0-9.e-]*\|"device_summed": [0-9]*\|"device_sums_issue_s": [0-9.e-]*\|"device_sums_read_s": [0-9.e-]*\|"summed_ahead": [0-9]*\|"pinned_ahead": [0-9]*' "$f" | tr '\n' ' '; echo
  done
}
warm_kernel() {
  python3 - <<'PY'
import time, torch
from megatron_ckpt_ext import _crc_device
torch.cuda.init(); torch.zeros(1, device="cuda")
t0 = time.perf_counter(); _crc_device.warm_up(0)
while not _crc_device.ready(0) and time.perf_counter() - t0 < 60:
    time.sleep(0.005)
print(f"device CRC warm-up: ready={_crc_device.ready(0)} in {time.perf_counter() - t0:.3f} s")
PY
}
warm_kernel; warm_kernel  # compiled, then from Triton's cache
for S in ${ORDER:-device device_hostsum host}; do
  case $S in
    device_hostsum) run_one "$S" MCX_RESTORE_SUMS=device MCX_DEVICE_CRC_TRITON=0 ;;
    *) run_one "$S" MCX_RESTORE_SUMS=$S ;;
  esac
done
[ "${PREP0:-0}" = 1 ] && run_one prep0 MCX_PREPARE_RESTORE=0
if [ "${PROBE:-1}" = 1 ]; then
  GIB=1.75; [ "$MODEL" = 1b ] && GIB=11.4
  timeout 120 python3 benchmarks/probe_build_beside_prepare.py --fresh --gib $GIB --repeats 3 \
    --variants none register presum prepare --json "$OUT/${CARD}_build_beside_prepare_fresh_$MODEL.json" \
    | tail -30
fi
