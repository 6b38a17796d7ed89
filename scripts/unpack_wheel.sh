#!/usr/bin/env bash
# Unpack a released cp312 wheel of a pure-Python backend into DIR, so tests on this Python can
# read or import a backend version pip cannot install here (nvidia-resiliency-ext >= 0.5 ships
# only cp312 manylinux_2_39 wheels; megatron-core 0.19.2's megatron_fsdp and megatron/training
# sources). Usage: unpack_wheel.sh DIST VERSION DIR
set -euo pipefail
dist=${1:?distribution, e.g. megatron-core}; ver=${2:?version, e.g. 0.19.2}; dir=${3:?target dir}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_39_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform any -d "$tmp" "$dist==$ver"
mkdir -p "$dir"
python3 -m zipfile -e "$tmp"/*.whl "$dir"
echo "unpacked $dist $ver into $dir"
