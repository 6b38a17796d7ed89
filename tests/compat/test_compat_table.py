"""docs/COMPAT.md's column for the installed backend equals what ``doctor --json`` reports."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from megatron_ckpt_ext import doctor

ROOT = Path(__file__).resolve().parents[2]


def _compat_table():
    spec = importlib.util.spec_from_file_location("compat_table", ROOT / "scripts" / "compat_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_table_matches_installed_backend():
    data = doctor.report()
    table = _compat_table().parse_table((ROOT / "docs" / "COMPAT.md").read_text())
    if data["backend"] not in table:
        if os.environ.get("MCE_COMPAT_REQUIRE_COLUMN"):
            pytest.fail(f"docs/COMPAT.md has no column for {data['backend']}; "
                        "run python scripts/compat_table.py --nvrx-dir .ext/nvrx-0.7.0")
        pytest.skip(f"docs/COMPAT.md has no column for {data['backend']}")
    reported = {row["feature"]: row["status"] for row in data["features"]}
    assert table[data["backend"]] == reported, (
        "docs/COMPAT.md is stale: run python scripts/compat_table.py --nvrx-dir .ext/nvrx-0.7.0")


def test_render_parse_round_trip():
    module = _compat_table()
    data = doctor.report()
    parsed = module.parse_table(module.render([data]))
    assert parsed == {data["backend"]: {r["feature"]: r["status"] for r in data["features"]}}
