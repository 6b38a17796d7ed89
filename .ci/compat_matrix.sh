#!/usr/bin/env bash
# The compat tests four ways: the default env (nvrx 0.4.1), nvrx 0.7.0 unpacked first on
# PYTHONPATH, nvrx hidden, and megatron-core main (Megatron-LM's megatron/ at a pinned commit,
# scripts/unpack_mcore_main.sh) with nvrx 0.7.0. Each pass states the nvrx it expects
# (MCE_EXPECT_NVRX; the main pass also MCE_EXPECT_MCORE), so a pass that silently ran against the
# wrong backend fails, and tests/compat/test_real_backend.py holds every detected field's expected
# value per backend. Exits non-zero on any failure; a pass that cannot run says SKIPPED and why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NVRX_NEW_VER=0.7.0
NVRX_NEW_DIR=.ext/nvrx-$NVRX_NEW_VER
MCORE_MAIN_DIR=.ext/mcore-main
MCORE_MAIN_VER=0.20.0+src  # what its core/package_info.py says, read from the source tree
# Unpacked from its released wheel once (scripts/unpack_nvrx.sh; the dist-info marks a complete one).
if [ ! -d "$NVRX_NEW_DIR/nvidia_resiliency_ext-$NVRX_NEW_VER.dist-info" ]; then
  rm -rf "$NVRX_NEW_DIR"
  bash scripts/unpack_nvrx.sh "$NVRX_NEW_VER" "$NVRX_NEW_DIR"
fi
# megatron-core main from a local Megatron-LM git repository (MEGATRON_LM_GIT); no GitHub here.
main_skip=""
if [ ! -f "$MCORE_MAIN_DIR/MEGATRON_LM_COMMIT" ]; then
  main_rc=0
  bash scripts/unpack_mcore_main.sh "$MCORE_MAIN_DIR" || main_rc=$?
  if [ "$main_rc" = 3 ]; then
    main_skip="no Megatron-LM git repository holding the pinned commit (set MEGATRON_LM_GIT)"
  elif [ "$main_rc" != 0 ]; then
    exit "$main_rc"
  fi
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
if [ -n "$main_skip" ]; then
  echo "== compat pass: megatron-core main SKIPPED: $main_skip"
else
  # its package __init__ needs triton (absent here): tests/compat/_mcore_source imports
  # megatron.core's subpackages without it, for the tree named by MCE_MCORE_SOURCE only
  MCE_MCORE_SOURCE="$PWD/$MCORE_MAIN_DIR" MCE_EXPECT_MCORE="$MCORE_MAIN_VER" run_pass \
    "megatron-core main ($(cat "$MCORE_MAIN_DIR/MEGATRON_LM_COMMIT"))" "$NVRX_NEW_VER" \
    "$PWD/$MCORE_MAIN_DIR:$PWD/tests/compat/_mcore_source:$PWD/$NVRX_NEW_DIR:$PWD"
fi
echo "== docs/COMPAT.md up to date"
if [ -n "$main_skip" ]; then
  "$PY" tools/compat_table.py --nvrx-dir "$NVRX_NEW_DIR" --check
else
  "$PY" tools/compat_table.py --nvrx-dir "$NVRX_NEW_DIR" --mcore-main "$MCORE_MAIN_DIR" --check
fi
