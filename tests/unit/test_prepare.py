"""``Checkpointer.prepare()``: the first save after it stages into the buffers it allocated
(counted by the stager, not timed)."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend


def _state(tensors: dict[str, torch.Tensor]) -> dict:
    st = backend.sharded_tensor_cls()
    return {k: st.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_the_first_save_after_prepare_stages_into_the_prepared_buffers(one_rank_group, tmp_path,
                                                                       persistent):
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(4096), "h": torch.arange(300.0)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          use_persistent_ckpt_worker=persistent,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare(_state(tensors))
        assert ck.wait_prepared(timeout_s=60)
        stats = ck.staging_stats()
        prepared = (stats["allocations"], stats["bytes_allocated"])
        assert prepared[1] >= sum(t.numel() * t.element_size() for t in tensors.values())
        ck.save(_state(tensors), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
        stats = ck.staging_stats()
        assert (stats["allocations"], stats["bytes_allocated"]) == prepared
        assert stats["stages"] == 1
        detail = ck.reports[-1]["stage_detail"]
        assert detail["allocations"] == 0 and detail["sets_built_at_stage"] == 0, detail


def test_the_report_says_what_a_first_save_without_prepare_spent_on_staging(one_rank_group,
                                                                           tmp_path):
    """The first save's report names its allocation (rank 0's stage_detail); the next save,
    into the same buffers, allocates nothing."""
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(4096)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        for it in (1, 2):
            ck.save(_state(tensors), tmp_path, iteration=it)
            ck.maybe_finalize(blocking=True)
        first, second = (r["stage_detail"] for r in ck.reports)
        assert first["allocations"] == 2 and first["allocate_s"] > 0, first
        assert "admit_s" in first and "admit_s" not in second, (first, second)
        assert second["allocations"] == 0 and second["allocate_s"] == 0, second


def _stacked_state(tensors: dict[str, list[torch.Tensor]]) -> dict:
    st = backend.sharded_tensor_cls()
    n = len(next(iter(tensors.values())))
    return {k: [st.from_rank_offsets(k, t, (0, i, n), replica_id=0, prepend_axis_num=1)
                for i, t in enumerate(v)] for k, v in tensors.items()}


@pytest.fixture
def validations(monkeypatch):
    """Every megatron-core sharding validation, as the validate_access_integrity it ran with
    (prepare()'s through state_dict_utils, the save's through serialization)."""
    import importlib

    seen: list[tuple[str, bool]] = []
    for where in ("state_dict_utils", "serialization"):
        module = importlib.import_module(f"megatron.core.dist_checkpointing.{where}")
        real = module.save_preprocess

        def spy(state, validate_access_integrity=True, *a, _real=real, _where=where, **k):
            seen.append((_where, bool(validate_access_integrity)))
            return _real(state, validate_access_integrity, *a, **k)

        monkeypatch.setattr(module, "save_preprocess", spy)
    return seen


def test_prepare_validates_and_converts_so_the_first_save_does_neither(one_rank_group, tmp_path,
                                                                         validations):
    layers = {"w": [torch.randn(4, 6) for _ in range(3)], "b": [torch.randn(5) for _ in range(3)]}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare(_stacked_state(layers))
        assert ck.wait_prepared(timeout_s=60)
        # megatron-core's check, at prepare; then its planning ahead, twice, not validating
        assert validations == [("state_dict_utils", True)] + [("serialization", False)] * 2
        cache = ck._planner.conversions
        assert len(cache.entries) == len(layers) and cache.misses == 0
        ck.save(_stacked_state(layers), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
        assert validations[3:] == [("serialization", False)]  # not again at the first save
        assert cache.misses == 0  # converted ahead, reused


@pytest.mark.parametrize("plan_ahead", ["1", "0"])
def test_prepare_validates_on_its_thread_without_holding_up_the_caller(one_rank_group, tmp_path,
                                                                      monkeypatch, plan_ahead):
    """megatron-core's validation runs first on prepare()'s own thread (with its host group):
    prepare() returns while it runs (a load, a training step go on); the first save waits for it
    and does not validate again. Without planning ahead (MCX_PLAN_AHEAD=0) prepare() validates
    before it returns, on the caller's thread."""
    import threading

    monkeypatch.setenv("MCX_PLAN_AHEAD", plan_ahead)
    release, threads = threading.Event(), []
    real = backend.validate_sharding

    def slow(*args, **kwargs):
        threads.append(threading.current_thread().name)
        release.wait(None if plan_ahead == "0" else 30)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "validate_sharding", slow)
    if plan_ahead == "0":
        release.set()
    layers = {"w": [torch.randn(4, 6) for _ in range(3)]}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare(_stacked_state(layers))
        if plan_ahead == "1":
            assert not ck.wait_prepared(timeout_s=0.5)  # validating, held by the test
            assert threads == ["mcx-staging-prepare"]
            release.set()
        else:
            assert threads == [threading.current_thread().name]
        ck.save(_stacked_state(layers), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
        assert len(threads) == 1 and ck.reports[-1]["stage_detail"].get(
            "validated_sharding") is not True


def test_a_first_save_of_another_structure_than_prepared_validates(one_rank_group, tmp_path,
                                                                  validations):
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare(_stacked_state({"w": [torch.randn(4, 6) for _ in range(3)]}))
        ck.save(_stacked_state({"w": [torch.randn(4, 7) for _ in range(3)]}), tmp_path,
                iteration=1)
        ck.maybe_finalize(blocking=True)
    # prepare() validated and planned ahead the structure it was given; the save of another
    # structure validates (and plans) again
    assert validations == ([("state_dict_utils", True)] + [("serialization", False)] * 2
                           + [("serialization", True)])


def test_the_first_save_after_a_load_stages_into_the_buffers_the_load_prepared(one_rank_group,
                                                                               tmp_path):
    """The load prepares the staging from the caller's state as it was handed over: megatron-
    core's load reassigns each ShardedTensor's data (a view with the prepended axes), which
    once left the load preparing buffers of other shapes for stacked layers and the first save
    after a resume allocating again; the caller's ShardedTensors are not changed either."""
    def layers():
        return {"w": [torch.randn(4, 6) for _ in range(3)], "b": [torch.randn(5) for _ in range(3)]}

    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.save(_stacked_state(layers()), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True, ckpt_memory_restore=False)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        given = _stacked_state(layers())
        shapes = [[tuple(t.data.shape) for t in v] for v in given.values()]
        ck.load(given, tmp_path)
        assert [[tuple(t.data.shape) for t in v] for v in given.values()] == shapes
        assert ck.wait_prepared(timeout_s=60)
        ck.save(_stacked_state(layers()), tmp_path, iteration=2)
        ck.maybe_finalize(blocking=True)
        detail = ck.reports[-1]["stage_detail"]
        assert detail["allocations"] == 0 and detail["sets_built_at_stage"] == 0, detail


def test_a_load_told_not_to_prepare_allocates_no_staging(one_rank_group, tmp_path):
    """``prepare_at_load = False`` (the launcher's, for a run without ``--save``): the load
    allocates no staging; a save that comes anyway allocates its own."""
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    state = {"w": [torch.randn(4, 6) for _ in range(3)]}
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.save(_stacked_state(state), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True, ckpt_memory_restore=False)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare_at_load = False
        ck.load(_stacked_state(state), tmp_path)
        assert ck.wait_prepared(timeout_s=60)
        assert ck.staging_stats().get("allocations", 0) == 0
        assert ck.load_reports[-1]["phases"]["prepare_save_s"] == 0.0
        ck.save(_stacked_state(state), tmp_path, iteration=2)
        ck.maybe_finalize(blocking=True)
        assert ck.reports[-1]["stage_detail"]["allocations"] > 0


@pytest.fixture
def plannings(monkeypatch):
    """How many times a save's planning made a global plan (megatron-core's save from its
    cached plan makes none)."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    made: list[str] = []
    for name in ("create_global_plan", "create_decentralized_global_plan"):
        real = getattr(MCoreSavePlanner, name, None)
        if real is None:
            continue

        def spy(self, *a, _real=real, _name=name, **k):
            made.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(MCoreSavePlanner, name, spy)
    return made


@pytest.mark.parametrize("ahead", ["1", "0"], ids=["planned-ahead", "MCX_PLAN_AHEAD=0"])
def test_the_first_save_after_prepare_finds_its_plan_made(one_rank_group, tmp_path, monkeypatch,
                                                          plannings, ahead):
    """prepare() plans the first save in its background thread (twice, as megatron-core trusts
    its cached plan from the second equal one): the first save plans nothing, as a steady one,
    and what it wrote loads back exactly. Switched off, the first two saves plan."""
    monkeypatch.setenv("MCX_PLAN_AHEAD", ahead)
    layers = {"w": [torch.randn(4, 6) for _ in range(3)], "b": [torch.randn(5) for _ in range(3)]}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    per_save = []
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare(_stacked_state(layers))
        assert ck.wait_prepared(timeout_s=60)
        per_save.append(len(plannings))
        for it in (1, 2, 3):
            ck.save(_stacked_state(layers), tmp_path, iteration=it)
            ck.maybe_finalize(blocking=True)
            per_save.append(len(plannings) - sum(per_save))
        empty = {k: [torch.zeros_like(t) for t in v] for k, v in layers.items()}
        loaded = ck.load(_stacked_state(empty), tmp_path)
        said = ["planned_ahead_s" in r["stage_detail"] for r in ck.reports]
    assert said == [ahead == "1", False, False]  # the first save's report says it
    planned = [n > 0 for n in per_save]  # at prepare(), then at saves 1, 2 and 3
    assert planned == ([True, False, False, False] if ahead == "1"
                       else [False, True, True, False]), per_save
    for k, v in layers.items():
        for i, t in enumerate(v):
            assert torch.equal(loaded[k][i].data.reshape(t.shape), t), (k, i)


def test_a_later_prepare_of_another_structure_plans_again(one_rank_group, tmp_path, plannings):
    """The launcher prepares twice after a resume: the load prepares from the state it loaded
    (without Megatron's rerun state), the first step from the state the save will build. The
    second plans again, and the first save plans nothing."""
    layers = {"w": [torch.randn(4, 6) for _ in range(3)]}
    grown = dict(layers, b=[torch.randn(5) for _ in range(3)])
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        for state in (layers, grown):
            ck.prepare(_stacked_state(state))
            assert ck.wait_prepared(timeout_s=60)
        ahead = len(plannings)
        ck.save(_stacked_state(grown), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
        assert "planned_ahead_s" in ck.reports[0]["stage_detail"]
    assert ahead > 0 and len(plannings) == ahead


def test_a_save_right_after_prepare_waits_for_the_plan_made_ahead(one_rank_group, tmp_path,
                                                                  monkeypatch, plannings):
    """A save called while prepare()'s thread still plans waits for it before its structure
    check, then uses that plan (planning nothing itself); its report counts the wait."""
    import time

    from megatron_ckpt_ext.save.planner import SavePlanner

    real = SavePlanner._plan_twice

    def slow(*a, **k):
        time.sleep(0.5)
        return real(*a, **k)

    monkeypatch.setattr(SavePlanner, "_plan_twice", slow)
    layers = {"w": [torch.randn(4, 6) for _ in range(3)]}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare(_stacked_state(layers))
        ck.save(_stacked_state(layers), tmp_path, iteration=1)  # no wait_prepared() first
        ahead = len(plannings)
        ck.maybe_finalize(blocking=True)
        detail = ck.reports[0]["stage_detail"]
    assert ahead > 0 and "planned_ahead_s" in detail, detail
    assert ck.reports[0]["phases"]["wait_prepare_s"] >= 0.3, ck.reports[0]


def test_the_seal_names_the_structure_of_the_latest_save(one_rank_group):
    """SavePlanner.digest(), which a save's seal names (a restore that matches it skips the
    sharding validation), follows the structure: made again when a save's structure is new,
    kept while it holds."""
    from types import SimpleNamespace

    from megatron_ckpt_ext.save.planner import SavePlanner, structure_digest

    planner = SavePlanner(CkptOptions(ckpt_assume_constant_structure=True))
    one = planner.key(_stacked_state({"w": [torch.randn(4, 6) for _ in range(3)]}))
    two = planner.key(_stacked_state({"w": [torch.randn(4, 7) for _ in range(3)]}))
    for key, new in ((one, True), (one, False), (two, True), (two, False)):
        planner.use(key, SimpleNamespace(new_structure=new))
        assert planner.digest()[0] == structure_digest(key)


def test_a_close_right_after_a_load_waits_for_the_planning_ahead_it_started(one_rank_group,
                                                                           tmp_path, monkeypatch):
    """A load prepares the next save in the background, planning included; a close that comes
    first (a job ending right after its resume) waits for it before it shuts the writers'
    queues: planned after them, megatron-core's writer started a spawned Manager server of its
    own, which nothing stopped (one orphan process per such rank)."""
    import multiprocessing.managers
    import time

    from megatron_ckpt_ext.save.planner import SavePlanner

    started, planned = [], []
    real_start, real_plan = multiprocessing.managers.BaseManager.start, SavePlanner.plan_ahead

    def start(self, *a, **k):  # noqa: ANN001
        started.append(self)
        return real_start(self, *a, **k)

    def late_plan(self, *a, **k):  # noqa: ANN001
        time.sleep(0.5)  # the close comes first
        planned.append(1)
        return real_plan(self, *a, **k)

    monkeypatch.setattr(multiprocessing.managers.BaseManager, "start", start)
    monkeypatch.setattr(SavePlanner, "plan_ahead", late_plan)
    tensors = {f"w{i}": torch.randn(256) for i in range(8)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          use_persistent_ckpt_worker=True, ckpt_assume_constant_structure=True)
    with Checkpointer(options) as ck:
        ck.save(_state(tensors), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
    with Checkpointer(options) as ck:
        ck.load(_state({k: torch.zeros_like(v) for k, v in tensors.items()}), tmp_path)
    assert planned == [1], planned  # the load's prepare planned, before its close returned
    for manager in started:
        manager.shutdown()
    assert not started, "a Manager server was started after the close"


def test_the_first_save_after_prepare_hands_its_lists_over_by_key_and_loads_exact(
        one_rank_group, tmp_path):
    """prepare() makes the first save's hand-over ahead (save/handover.py ``made_ahead``): that
    save pickles none of the lists the persistent writer keeps in full, as a steady save; the
    writer builds them from the bytes made ahead and writes this save's values."""
    from megatron_ckpt_ext.save import handover

    tensors = {f"t{i}": torch.randn(8, i + 1) for i in range(handover.MIN_LENGTH + 4)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          use_persistent_ckpt_worker=True, ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        before = dict(handover.stats)
        ck.prepare(_state(tensors))
        assert ck.wait_prepared(timeout_s=60)
        assert handover.stats["made_ahead"] > before["made_ahead"]
        for t in tensors.values():
            t.mul_(3.0)  # the save's values, not prepare()'s
        before = dict(handover.stats)
        ck.save(_state(tensors), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
        assert handover.stats["sent_whole"] == before["sent_whole"], handover.stats
        assert handover.stats["sent_known"] > before["sent_known"]
        got = ck.load(_state({k: torch.zeros_like(t) for k, t in tensors.items()}), tmp_path)
    assert all(torch.equal(got[k], t) for k, t in tensors.items())
