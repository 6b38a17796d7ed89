#!/usr/bin/env bash
# The main job (README): set up, then a tiny GPT trained on CPU with 2 ranks (gloo), saving
# asynchronously with CPU shared-memory staging and the constant-structure cache, then a fresh run
# resumed from the mid-point checkpoint; prints the resume verdict and the per-save report.
# Extra arguments go to run_recipe.py (e.g. --keep to keep the run directory).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" scripts/run_recipe.py configs/gpt_tiny_async_cpu_shm_constant.yaml "$@"
