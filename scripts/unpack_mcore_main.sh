#!/usr/bin/env bash
# Materialise megatron-core's main branch (Megatron-LM's `megatron/` tree at a pinned commit) into
# DIR, so the compat layer is tested against the next Megatron without network access to GitHub
# (there is no 0.20 wheel on PyPI). Reads a local Megatron-LM git repository: $MEGATRON_LM_GIT
# (a git dir or a checkout), by default the mirror at /work/.mirror/NVIDIA+Megatron-LM/repo.
# The commit is written to DIR/MEGATRON_LM_COMMIT last: it marks a complete copy.
# Usage: unpack_mcore_main.sh DIR    (exit 3 when no repository holding the commit is found)
set -euo pipefail
dir=${1:?target dir, e.g. .ext/mcore-main}
commit=${MCORE_MAIN_COMMIT:-d98e8a64ddf34856e74b24714e3bedb2f5a39553}
default_repo=/work/.mirror/NVIDIA+Megatron-LM/repo
repo=${MEGATRON_LM_GIT:-}
if [ -z "$repo" ] && [ -d "$default_repo" ]; then repo=$default_repo; fi
if [ -z "$repo" ]; then
  echo "no Megatron-LM git repository: set MEGATRON_LM_GIT (default $default_repo is absent)" >&2
  exit 3
fi
if ! git -C "$repo" cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "$repo does not hold Megatron-LM commit $commit (git fetch it there first)" >&2
  exit 3
fi
rm -rf "$dir"
mkdir -p "$dir"
git -C "$repo" archive --format=tar "$commit" megatron | tar -x -C "$dir"
[ -f "$dir/megatron/core/package_info.py" ] || { echo "no megatron/core in $commit" >&2; exit 1; }
echo "$commit" > "$dir/MEGATRON_LM_COMMIT"
echo "unpacked megatron/ of Megatron-LM $commit into $dir"
