#!/usr/bin/env bash
# The compat tests three ways: the default env (nvrx 0.4.1), nvrx 0.7.0 unpacked first on
# PYTHONPATH, nvrx hidden. Each pass states the nvrx it expects (MCE_EXPECT_NVRX), so a pass that
# silently ran against the wrong backend fails, and tests/compat/test_real_backend.py holds every
# detected field's expected value per backend. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NVRX_NEW_VER=0.7.0
NVRX_NEW_DIR=.ext/nvrx-$NVRX_NEW_VER
# Unpacked from its released wheel once (scripts/unpack_nvrx.sh; the dist-info marks a complete one).
if [ ! -d "$NVRX_NEW_DIR/nvidia_resiliency_ext-$NVRX_NEW_VER.dist-info" ]; then
  rm -rf "$NVRX_NEW_DIR"
  bash scripts/unpack_nvrx.sh "$NVRX_NEW_VER" "$NVRX_NEW_DIR"
fi
base=${PYTHONPATH:-}
run_pass() {  # name, expected nvrx, PYTHONPATH prefix
  echo "== compat pass: $1 (expects nvrx $2)"
  PYTHONPATH="$3${base:+:$base}" MCE_EXPECT_NVRX="$2" MCE_COMPAT_REQUIRE_COLUMN=1 \
    timeout 300 "$PY" -m pytest -p no:cacheprovider -rfEs tests/compat
}
run_pass default 0.4.1 "$PWD"
run_pass "nvrx $NVRX_NEW_VER" "$NVRX_NEW_VER" "$PWD/$NVRX_NEW_DIR:$PWD"
run_pass "nvrx hidden" none "$PWD/tests/compat/_hide_nvrx:$PWD"
echo "== docs/COMPAT.md up to date"
"$PY" tools/compat_table.py --nvrx-dir "$NVRX_NEW_DIR" --check
