#!/usr/bin/env bash
# Set up a fresh machine (or an existing Megatron environment) for this package: idempotent.
# - torch: an already-installed torch is kept as it is (a Megatron user's CUDA build must never be
#   replaced). Only when no torch is importable is torch==2.13.0 installed, which on our CI/dev
#   image is a local CPU wheel (no multi-GB CUDA download).
# - then this package in editable mode with its test extra: megatron-core and
#   nvidia-resiliency-ext at the newest versions pip offers this Python (0.16.1 / 0.4.1 on 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
if ! "$PY" -c "import megatron_ckpt_ext, megatron.core, pytest_mock, pytest_timeout, yaml" 2>/dev/null; then
  echo "[setup] installing megatron-ckpt-ext (editable) with test extras"
  "$PY" -m pip install -q -e ".[test]"
fi
"$PY" - <<'PYEOF'
import importlib.metadata as md
for name in ("torch", "megatron-core", "nvidia-resiliency-ext"):
    try:
        print(f"[setup] {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"[setup] {name} not installed")
PYEOF
