"""Shared fixtures. Tests run on CPU-only torch; nothing here needs a GPU."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture
def caps_factory():
    """Real backend capabilities with chosen fields overridden (pins validation branches)."""
    from megatron_ckpt_ext import backend

    def make(**overrides):
        return dataclasses.replace(backend.detect(), **overrides)

    return make
