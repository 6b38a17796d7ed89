"""The checkpoint's own small collectives never touch the device: over a group whose only
backend is NCCL (Megatron-LM's world) they run on a gloo group of the same ranks. On the GPU a
result read back from the device waited behind the save's device-to-host copies in flight, and
planning, which those copies should overlap, waited for all of them (docs/notes/megatron_lm.md).
On CPU the groups report NCCL by a patch: a collective that still chose the device fails here
(no CUDA)."""

from __future__ import annotations

from tests._support.dist import run_ranks

from . import _control_workers as workers


def test_collectives_over_an_nccl_world_run_on_a_gloo_group_on_the_host():
    run_ranks(workers.world_reports_nccl, world_size=2, timeout=90)


def test_collectives_over_an_nccl_subgroup_are_made_by_its_members_alone(monkeypatch):
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")  # inherited by the spawned ranks
    run_ranks(workers.subgroup_reports_nccl, world_size=3, timeout=60)


def test_megatron_cores_planning_collectives_run_on_the_host_group(tmp_path):
    """The first save of a structure (validation and plan) and the next (the cached plan's
    check) plan with megatron-core's and torch DCP's object collectives on the default group:
    over NCCL they waited behind the save's copies (1B on H100: planning 0.23-0.31 s, the copy
    0.22 s). They run on the gloo group instead."""
    run_ranks(workers.planning_collectives_on_the_host, world_size=2, timeout=120,
              args=(str(tmp_path),))


def test_without_gloo_the_collectives_stay_on_the_given_group_with_one_warning():
    run_ranks(workers.no_gloo_falls_back_with_one_warning, world_size=2, timeout=60)
