#!/usr/bin/env bash
# Set up a fresh machine (or an existing Megatron environment) for this package: idempotent.
# The versions the tests assume are pinned in constraints/ci-py311.txt (MCX_CONSTRAINTS=FILE for
# another): torch, megatron-core, nvidia-resiliency-ext, pyyaml and the test extra.
# - torch: an installed torch is never replaced (a Megatron user's CUDA build), in CI either. Only
#   where none is installed is the pinned one installed (on the CI image a local CPU wheel).
# - this package in editable mode with its test extra, `pip install -c` the pins; in a user's
#   environment every pinned package already installed is kept at its version.
# - then the installed versions are checked against the pins. Strict where CI=true or MCX_CI=1
#   (MCX_CI=0 turns it off): the Python must be the one the file is for and every pin must match,
#   else setup fails naming the package and the fix (pip first replaces mismatched packages other
#   than torch). Otherwise a mismatch is a warning.
# Nothing is installed when everything already matches: a second run is quick and offline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONSTRAINTS=${MCX_CONSTRAINTS:-constraints/ci-py311.txt}
STRICT=0
if [ -n "${MCX_CI:-}" ]; then
  [ "$MCX_CI" = 1 ] && STRICT=1
elif [ "${CI:-}" = true ]; then
  STRICT=1
fi
[ -f "$CONSTRAINTS" ] || { echo "[setup] no constraints file $CONSTRAINTS (MCX_CONSTRAINTS)" >&2; exit 2; }
exec "$PY" - "$CONSTRAINTS" "$STRICT" <<'PYEOF'
import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# What is installed, not this checkout's egg-info (the working directory is the repo root).
sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
path, strict = sys.argv[1], sys.argv[2] == "1"
mode = "strict (CI=true or MCX_CI=1)" if strict else "lenient (set MCX_CI=1 to enforce)"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins() -> dict[str, str]:
    pins = {}
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        if not m:
            sys.exit(f"[setup] {path}:{n}: {raw.strip()!r} is not NAME==VERSION; pin exact versions only")
        pins[norm(m[1])] = m[2]
    return pins


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def same(have: str | None, pin: str) -> bool:  # 2.13.0+cpu is torch==2.13.0, as pip reads it
    return have is not None and have.split("+")[0] == pin.split("+")[0]


def installed_here() -> bool:
    """This checkout is what pip has installed, editable (not another clone, not a plain copy)."""
    try:
        info = json.loads(md.distribution("megatron-ckpt-ext").read_text("direct_url.json") or "{}")
    except md.PackageNotFoundError:
        return False
    return bool(info.get("dir_info", {}).get("editable")) and info.get("url") == Path.cwd().resolve().as_uri()


problems: list[str] = []


def problem(text: str) -> None:
    problems.append(text)
    print(f"[setup] {'ERROR' if strict else 'WARNING'}: {text}", file=sys.stderr)


pins = read_pins()
want_py = re.search(r"py3(\d+)", Path(path).name)
if want_py and sys.version_info[:2] != (3, int(want_py[1])):
    problem(f"this is Python {platform.python_version()}; {path} pins the versions CI tests on "
            f"Python 3.{want_py[1]}: run with PYTHON=python3.{want_py[1]}")
torch_pin, torch_have = pins.get("torch"), installed("torch")
if torch_pin and torch_have is not None and not same(torch_have, torch_pin):
    problem(f"torch {torch_have} is installed and {path} pins torch=={torch_pin}; setup.sh never "
            f"replaces an installed torch: install it yourself (pip install torch=={torch_pin})"
            + (", or set MCX_CI=0 to test against yours" if strict else ""))
if strict and problems:
    sys.exit(1)

missing = [n for n in pins if installed(n) is None]
mismatched = [n for n in pins if n != "torch" and n not in missing and not same(installed(n), pins[n])]
here = installed_here()
if missing or not here or (strict and mismatched):
    why = ([f"missing {', '.join(missing)}"] if missing else []) + \
          ([] if here else ["megatron-ckpt-ext not installed (editable) from this checkout"]) + \
          ([f"not at the pins: {', '.join(mismatched)}"] if strict and mismatched else [])
    # Keep what must not move: torch always, in a user's environment every installed package.
    keep = {n: installed(n) for n in pins if installed(n) is not None and (n == "torch" or not strict)}
    lines = [f"{n}=={keep.get(n, v)}" for n, v in pins.items()]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="mcx-constraints-", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    print(f"[setup] installing megatron-ckpt-ext (editable, test extra) with {path} ({'; '.join(why)})")
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", f.name,
                            "-e", ".[test]", *pins], check=False)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        kept = ", ".join(f"{n}=={v}" for n, v in keep.items()) or "none"
        sys.exit(f"[setup] pip install -c {path} -e '.[test]' failed (exit {r.returncode}; kept as "
                 f"installed: {kept}); its message is above")

for n, pin in pins.items():
    have = installed(n)
    print(f"[setup] {n} {have or 'not installed'}" + ("" if same(have, pin) else f" (pinned {pin})"))
    if n != "torch" and not same(have, pin):
        problem(f"{n} {have or 'is not installed'}: {path} pins {n}=={pin}; "
                f"fix: pip install -c {path} '{n}=={pin}'")
if not installed_here():
    problem("megatron-ckpt-ext is not installed from this checkout: pip install -e '.[test]'")
if problems and strict:
    sys.exit(f"[setup] {len(problems)} problem(s) with the pinned versions ({mode}); see above")
print(f"[setup] ok: {path}, {mode}" + (f", {len(problems)} warning(s)" if problems else ""))
PYEOF
