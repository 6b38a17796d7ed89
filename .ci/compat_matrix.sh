#!/usr/bin/env bash
# The compat tests three ways: the default env (nvrx 0.4.1), nvrx 0.7.0 unpacked first on
# PYTHONPATH, nvrx hidden. Each pass states the nvrx it expects (MCE_EXPECT_NVRX), so a pass that
# silently ran against the wrong backend fails. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NVRX_NEW_VER=0.7.0
NVRX_NEW_DIR=.ext/nvrx-$NVRX_NEW_VER
if [ ! -d "$NVRX_NEW_DIR/nvidia_resiliency_ext" ]; then
  if [ -d /tmp/nvrx070/nvidia_resiliency_ext ]; then
    mkdir -p .ext && cp -r /tmp/nvrx070 "$NVRX_NEW_DIR"
  else
    bash scripts/unpack_nvrx.sh "$NVRX_NEW_VER" "$NVRX_NEW_DIR"
  fi
fi
base=${PYTHONPATH:-}
run_pass() {  # name, expected nvrx, PYTHONPATH prefix
  echo "== compat pass: $1 (expects nvrx $2)"
  PYTHONPATH="$3${base:+:$base}" MCE_EXPECT_NVRX="$2" MCE_COMPAT_REQUIRE_COLUMN=1 \
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/compat
}
run_pass default 0.4.1 "$PWD"
run_pass "nvrx $NVRX_NEW_VER" "$NVRX_NEW_VER" "$PWD/$NVRX_NEW_DIR:$PWD"
run_pass "nvrx hidden" none "$PWD/tests/compat/_hide_nvrx:$PWD"
echo "== docs/COMPAT.md up to date"
"$PY" scripts/compat_table.py --nvrx-dir "$NVRX_NEW_DIR" --check
