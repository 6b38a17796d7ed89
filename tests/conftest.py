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


@pytest.fixture()
def one_rank_group():
    """A gloo process group of one rank in the test process (megatron-core's save and load need
    one), torn down after the test."""
    from datetime import timedelta

    import torch.distributed as dist

    from tools._dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()
