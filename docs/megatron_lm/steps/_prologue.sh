# Sourced by step scripts run on the GPU machine from the repository root: installs the carried
# wheels into .site, puts the repository and .site on PYTHONPATH, sets CARD (h100 / h200) and
# prints the CRC-32 implementation in use.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/.site
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
python3 -m megatron_ckpt_ext doctor 2>&1 | grep -i crc
# collect_run RUN_DIR NAME: a finished gpu_real_client.sh run's real_client.json and logs.tgz into
# $OUT as NAME.json and NAME_logs.tgz; an unfinished one's files as NAME_partial_logs.tgz.
collect_run() {
  if [ -f "$1/real_client.json" ]; then
    cp "$1/real_client.json" "$OUT/$2.json"
    cp "$1/logs.tgz" "$OUT/$2_logs.tgz"
  else
    echo "no real_client.json: the run did not finish"
    tar -czf "$OUT/$2_partial_logs.tgz" -C "$1" . 2>/dev/null
  fi
}
