# Sourced by step scripts run on the GPU machine from the repository root: installs the carried
# wheels into .site, puts the repository and .site on PYTHONPATH, sets CARD (h100 / h200) and
# prints the CRC-32 implementation in use.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/.site
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
python3 -m megatron_ckpt_ext doctor 2>&1 | grep -i crc
