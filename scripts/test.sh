#!/usr/bin/env bash
# The test command (README and .ci/run): set up (the pinned versions, scripts/setup.sh), then the
# whole CPU suite (its three tiers: tests/unit, tests/functional, tests/compat), then the compat
# matrix (the compat tests again against nvrx 0.7.0 unpacked, and with nvrx hidden). pytest prints
# each test file with its results, the reason of every skip and the slowest tests (the whole
# .ci/run must stay under 30 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
# megatron-core 0.19.2's sources (megatron_fsdp's experimental fully_shard, megatron/training): the
# tests that read or run them are skipped without this folder. Unpacked once into .ext/.
if [ -z "${MCORE0192_DIR:-}" ]; then
  export MCORE0192_DIR=$PWD/.ext/mcore-0.19.2
  [ -d "$MCORE0192_DIR/megatron/core" ] || bash scripts/unpack_wheel.sh megatron-core 0.19.2 "$MCORE0192_DIR"
fi
"$PY" -m pytest -p no:cacheprovider -rfEs --durations=15 tests "$@"
if [ -f .ci/compat_matrix.sh ]; then
  bash .ci/compat_matrix.sh
fi
