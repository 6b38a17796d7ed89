#!/usr/bin/env bash
# The test command (README and .ci/run): set up, then the whole CPU suite, then the compat matrix
# (the compat tests again against nvrx 0.7.0 unpacked, and with nvrx hidden).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
if [ -f .ci/compat_matrix.sh ]; then
  bash .ci/compat_matrix.sh
fi
