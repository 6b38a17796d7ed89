"""docs/COMPAT.md's column for the installed backend equals what ``doctor --json`` reports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_ckpt_ext import doctor
from tests._support import load_script

ROOT = Path(__file__).resolve().parents[2]


def _compat_table():
    return load_script("tools/compat_table.py", "compat_table")


def test_committed_table_matches_installed_backend():
    data = doctor.report()
    table = _compat_table().parse_table((ROOT / "docs" / "COMPAT.md").read_text())
    if data["backend"] not in table:
        if os.environ.get("MCE_COMPAT_REQUIRE_COLUMN"):
            pytest.fail(f"docs/COMPAT.md has no column for {data['backend']}; "
                        "run python tools/compat_table.py --nvrx-dir .ext/nvrx-0.7.0")
        pytest.skip(f"docs/COMPAT.md has no column for {data['backend']}")
    reported = {row["feature"]: row["status"] for row in data["features"]}
    differ = {f: f"table {table[data['backend']].get(f)!r}, doctor {reported.get(f)!r}"
              for f in sorted(set(reported) | set(table[data["backend"]]))
              if table[data["backend"]].get(f) != reported.get(f)}
    # The table is a snapshot, not the guard of the detections: tests/compat/test_real_backend.py
    # holds each field's value read from the release's source, so a changed detection fails there.
    assert not differ, (
        f"docs/COMPAT.md's column {data['backend']!r} differs from doctor: {differ}. If "
        "tests/compat/test_real_backend.py fails too, a detection changed: fix that first. Only "
        "when it passes, regenerate: python tools/compat_table.py --nvrx-dir .ext/nvrx-0.7.0")


def test_render_parse_round_trip():
    module = _compat_table()
    data = doctor.report()
    parsed = module.parse_table(module.render([data]))
    assert parsed == {data["backend"]: {r["feature"]: r["status"] for r in data["features"]}}
