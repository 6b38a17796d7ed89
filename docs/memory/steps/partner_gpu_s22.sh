#!/usr/bin/env bash
# One call on one GPU (carry .whl): benchmarks/bench_partner.py with two ranks on the one GPU,
# each its own "node" (its own shared-memory directory), the state on the device: what partner
# copies cost per save and what a restart after a lost node gets, on the GPU host (16 cores).
# Results: $OUT/<card>_partner_2gib.json and its .log; with PROBE=1 first the wire probe
# (benchmarks/partner_wire_probe.py: loopback TCP into a new segment, by receive path),
# $OUT/<card>_partner_wire.json. From the repository root:
#   OUT=$OUT bash docs/memory/steps/partner_gpu_s22.sh
set -uo pipefail
source docs/megatron_lm/steps/_prologue.sh
df -h /dev/shm / | tail -2
nproc
if [ "${PROBE:-0}" = 1 ]; then
  timeout -k 10 120 python3 benchmarks/partner_wire_probe.py --gib 2 --repeats 3 \
    --json "$OUT/${CARD}_partner_wire.json" 2>&1 | grep -v "Warning\|pynvml"
fi
timeout -k 10 ${BUDGET:-500} python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  benchmarks/bench_partner.py --device cuda --gib ${GIB:-2} --saves 3 --rounds 2 \
  --step-matmuls ${MATMULS:-3000} --out /tmp/bench_partner \
  --json "$OUT/${CARD}_partner_${GIB:-2}gib.json" > "$OUT/${CARD}_partner_${GIB:-2}gib.log" 2>&1
echo "rc=$?"
grep -v "Warning\|warn\|pynvml\|load_state_dict" "$OUT/${CARD}_partner_${GIB:-2}gib.log" | tail -60
