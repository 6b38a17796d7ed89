"""The Megatron-LM adapter (megatron_ckpt_ext.megatron_lm), on stand-ins of megatron.training.

The stand-in modules are built from the signatures recorded from megatron-core 0.19.2's real
sources (see test_backend_mlm.py); the Checkpointer is a fake that records calls, so these tests
pin the adapter's routing: what Megatron's calls turn into, and when Megatron's callbacks run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest

from megatron_ckpt_ext import CkptOptions, backend, megatron_lm
from megatron_ckpt_ext.errors import MegatronAdapterError
from tests._support.mlm_seams import RECORDED, modules_from


class FakeCheckpointer:
    def __init__(self, options: CkptOptions) -> None:
        self.options = options
        self.dp_group = None  # as the real one built before Megatron's groups exist
        self.saves: list[tuple[dict, str, int]] = []
        self.loads: list[tuple[str, int]] = []
        self.finalize_calls: list[bool] = []
        self.durable: list[int] = []  # iterations whose write has finished
        self.closed = False
        self.reports = []
        self.prepared: list = []  # states given to prepare()
        self.restores_prepared: list = []  # (--load, what Megatron had done by then)
        self.prepared_early: list[bool] = []  # each prepare_restore's early= (the copy ahead)
        self.events: list = []
        self.common_checks: list = []  # the preprocess_common each save/prepare was given

    def prepare(self, sharded_state_dict, *, preprocess_common=None):
        self.prepared.append(sharded_state_dict)
        self.common_checks.append(("prepare", preprocess_common))

    def prepare_restore(self, checkpoint_dir, *, early=False):
        self.restores_prepared.append((checkpoint_dir, list(self.events)))
        self.prepared_early.append(early)
        return True

    def save(self, sharded_state_dict, checkpoint_dir, *, iteration, preprocess_common=None):
        self.saves.append((sharded_state_dict, checkpoint_dir, iteration))
        self.common_checks.append(("save", preprocess_common))
        self.reports.append({"iteration": iteration, "blocking_s": 0.0})
        if not self.options.async_save:
            self.durable.append(iteration)

    def maybe_finalize(self, *, blocking=False):
        self.finalize_calls.append(blocking)
        if blocking:
            self.durable = sorted({*self.durable, *(s[2] for s in self.saves)})
        done, self.durable = self.durable, []
        return done

    prepare_at_load = True
    pin_at_load = True

    def load(self, sharded_state_dict, checkpoint_dir, *, iteration=None):
        self.loads.append((checkpoint_dir, iteration))
        return {"loaded_by": "checkpointer"}

    def close(self, *, after_error=False):
        self.closed = "after an error" if after_error else True


@pytest.fixture
def mlm():
    """Stand-in megatron.training modules; the adapter is uninstalled after each test."""
    mods = modules_from(RECORDED["0.19.2"])
    real_dc = types.SimpleNamespace(save=lambda *a, **k: "stock-save",
                                    load=lambda *a, **k: {"loaded_by": "stock"},
                                    check_is_distributed_checkpoint=lambda path: True)
    mods["checkpointing"].dist_checkpointing = real_dc
    deletions: list[bool] = []
    mods["checkpointing"].finalize_deletion_processes = lambda blocking=False: deletions.append(blocking)
    yield types.SimpleNamespace(mods=mods, real_dc=real_dc, deletions=deletions)
    megatron_lm.uninstall()


def _install(mlm, **options):
    made: list[FakeCheckpointer] = []

    def factory(opts):
        made.append(FakeCheckpointer(opts))
        return made[-1]

    megatron_lm.install(options=CkptOptions(**options), checkpointer_factory=factory,
                        modules=mlm.mods)
    return made


def test_importing_the_adapter_does_not_import_megatron():
    code = ("import sys, megatron_ckpt_ext.megatron_lm as m; "
            "bad = [k for k in sys.modules if k.startswith(('megatron.', 'nvidia_resiliency_ext'))];"
            "print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_install_without_megatron_training_names_version_and_reason():
    if backend.megatron_training_seams().ok:
        pytest.skip("megatron.training is importable here")
    with pytest.raises(MegatronAdapterError, match=r"megatron-core .*megatron\.training"):
        megatron_lm.install()
    assert not megatron_lm.is_installed()


def test_missing_seam_refuses_with_one_error_and_patches_nothing(mlm):
    del mlm.mods["training"].maybe_finalize_async_save
    original = mlm.mods["checkpointing"].schedule_async_save
    with pytest.raises(MegatronAdapterError,
                       match=r"0\.\d+.*training\.maybe_finalize_async_save \(absent\)"):
        _install(mlm, async_save=True)
    assert mlm.mods["checkpointing"].schedule_async_save is original
    assert mlm.mods["checkpointing"].dist_checkpointing is mlm.real_dc


def test_async_save_runs_megatron_callbacks_only_after_our_commit(mlm):
    made = _install(mlm, async_save=True)
    ckpting, training = mlm.mods["checkpointing"], mlm.mods["training"]
    state = {"w": 1}
    request = ckpting.dist_checkpointing.save(state, "/ckpt/iter_0000005", object(),
                                              async_sharded_save=True)
    calls: list[str] = []
    request.add_finalize_fn(lambda: calls.append("tracker"))
    ckpting.schedule_async_save(request)
    (checkpointer,) = made
    assert checkpointer.saves == [(state, "/ckpt", 5)]
    assert ckpting.is_empty_async_queue() is False

    training.maybe_finalize_async_save(blocking=False)
    assert calls == []  # write not durable yet: Megatron's tracker line must wait
    checkpointer.durable.append(5)
    training.maybe_finalize_async_save(blocking=False)
    assert calls == ["tracker"]
    assert ckpting.is_empty_async_queue() is True
    assert mlm.deletions == [False, False]  # Megatron's own deletion cleanup still runs


def test_terminate_drains_and_keeps_the_checkpointer_for_the_end_of_training_save(mlm):
    """Megatron terminates its async queue when its training loop ends, then saves once more:
    that save must find the same Checkpointer (its writer and staging), not build a new one."""
    made = _install(mlm, async_save=True)
    ckpting = mlm.mods["checkpointing"]
    request = ckpting.dist_checkpointing.save({}, "/ckpt/iter_0000010", None, async_sharded_save=True)
    calls: list[int] = []
    request.add_finalize_fn(lambda: calls.append(10))
    ckpting.schedule_async_save(request)
    mlm.mods["training"].maybe_finalize_async_save(blocking=False, terminate=True)
    assert calls == [10]  # drained, even when Megatron does not ask to block
    assert made[0].finalize_calls[-1] is True and not made[0].closed
    ckpting.schedule_async_save(ckpting.dist_checkpointing.save(
        {}, "/ckpt/iter_0000012", None, async_sharded_save=True))  # the end-of-training save
    mlm.mods["training"].maybe_finalize_async_save(blocking=True, terminate=True)
    assert len(made) == 1 and [s[2] for s in made[0].saves] == [10, 12]


def test_at_exit_an_idle_checkpointer_is_closed_and_a_pending_save_is_left_alone(mlm):
    import os

    made = _install(mlm, async_save=True)
    ckpting = mlm.mods["checkpointing"]
    ckpting.schedule_async_save(ckpting.dist_checkpointing.save(
        {}, "/ckpt/iter_0000010", None, async_sharded_save=True))
    made[0].idle = False  # a save not finalized: draining it would need every rank
    megatron_lm._close_at_exit.run(os.getpid())
    assert not made[0].closed
    made[0].idle = True
    megatron_lm._close_at_exit.run(os.getpid() + 1)  # registered by another process: not ours
    assert not made[0].closed
    megatron_lm._close_at_exit.run(os.getpid())
    assert made[0].closed is True and megatron_lm._state.checkpointer is None


def test_at_exit_after_an_uncaught_exception_the_snapshot_is_kept(mlm, monkeypatch):
    import os
    import sys

    made = _install(mlm, async_save=True)
    mlm.mods["checkpointing"].dist_checkpointing.save({}, "/ckpt/iter_0000010", None,
                                                      async_sharded_save=False)
    monkeypatch.setattr(sys, "last_value", RuntimeError("NCCL timeout"), raising=False)
    megatron_lm._close_at_exit.run(os.getpid())
    assert made[0].closed == "after an error"  # Checkpointer.close(after_error=True) keeps it


def _train_step_stand_ins(mlm, *, save="/ckpt", no_save_rng=False):
    """0.19.2's train_step, generate_state_dict, sharding-metadata builder, get_rng_state and
    rerun state machine (their signatures), recording what the adapter passes."""
    built: list[tuple] = []
    ckpting, training = mlm.mods["checkpointing"], mlm.mods["training"]
    ckpting.get_args = lambda: argparse.Namespace(save=save, ckpt_format="torch_dist",
                                                  no_save_rng=no_save_rng)

    def get_rng_state(ckpt_format, tp_group, pp_group, dp_cp_group=None, dp_group=None,
                      key_prefix=""):
        return ("rng", ckpt_format, tp_group, pp_group)

    class RerunStateMachine:
        def state_dict(self, data_iterator, ckpt_format, force=False):
            return ("rerun", data_iterator, ckpt_format)

    ckpting.get_rng_state = get_rng_state
    ckpting.mpu = types.SimpleNamespace(get_tensor_model_parallel_group=lambda: "tp",
                                        get_pipeline_model_parallel_group=lambda: "pp",
                                        get_data_parallel_group=lambda **k: None)
    ckpting.get_rerun_state_machine = RerunStateMachine

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None, pg_collection=None,
                   p2p_communicator=None):
        return ("loss", iteration)

    def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state,
                            iteration=None, optim_sd_kwargs=None, model_sd_kwargs=None,
                            rerun_state=None):
        built.append((model, optimizer, opt_param_scheduler, rng_state, optim_sd_kwargs,
                      rerun_state))
        return {"model": model, "optimizer": optimizer}

    def _build_sharded_state_dict_metadata(args, dp_cp_group=None):
        return {"distrib_optim_sharding_type": "dp_reshardable"}

    training.train_step = train_step
    ckpting.generate_state_dict = generate_state_dict
    # save_checkpoint's own unwrap_model (DDP and Float16Module wrappers off)
    ckpting.unwrap_model = lambda model: [m.removeprefix("wrapped-") for m in model]
    ckpting._build_sharded_state_dict_metadata = _build_sharded_state_dict_metadata
    return built


def test_the_first_train_step_prepares_the_staging_for_the_state_megatron_will_save(mlm):
    built = _train_step_stand_ins(mlm)
    made = _install(mlm, async_save=True)
    training = mlm.mods["training"]
    for i in (1, 2, 3):
        result = training.train_step("fwd", "data", ["wrapped-m"], "opt", "sched", "cfg", "fb",
                                     iteration=i)
        assert result == ("loss", i)  # Megatron's own step, untouched
    # once, after the first step, from the step's own model (unwrapped, as save_checkpoint
    # does: the wrapped model's tensors have other names), optimizer and scheduler, with
    # Megatron's sharding metadata, RNG state (from the model-parallel groups, as
    # save_checkpoint gathers it) and rerun state: the save's plan names them
    assert built == [(["m"], "opt", "sched", ("rng", "torch_dist", "tp", "pp"),
                      {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}},
                      ("rerun", None, "torch_dist"))]
    assert len(made) == 1 and made[0].prepared == [{"model": ["m"], "optimizer": "opt"}]


def test_megatrons_common_state_preprocessing_reaches_prepare_and_every_save(mlm):
    """Megatron-LM's save compares the ranks' common states after its
    ``preprocess_common_state_dict`` (it drops ``args.rank``, which differs by rank); without it
    every rank but 0 warns "common state dict differs" at each validated save."""
    _train_step_stand_ins(mlm)
    made = _install(mlm, async_save=True)

    def megatrons(common):
        return common

    mlm.mods["training"].preprocess_common_state_dict = megatrons
    mlm.mods["training"].train_step("fwd", "data", ["m"], "opt", "sched", "cfg", "fb")
    mlm.mods["checkpointing"].dist_checkpointing.save(
        {}, "/ckpt/iter_0000005", None, async_sharded_save=True,
        preprocess_common_before_consistancy_check=megatrons)
    assert made[0].common_checks == [("prepare", megatrons), ("save", megatrons)]


def test_with_no_save_rng_the_prepared_state_has_no_rng_state_as_the_save(mlm):
    built = _train_step_stand_ins(mlm, no_save_rng=True)
    _install(mlm, async_save=True)
    mlm.mods["training"].train_step("fwd", "data", ["m"], "opt", "sched", "cfg", "fb")
    assert [b[3] for b in built] == [None]


def test_the_first_train_step_imports_what_megatrons_first_async_save_would(mlm, tmp_path,
                                                                           monkeypatch):
    """Megatron-LM 0.19's save_checkpoint imports megatron.training.distillation inside its
    first async save: the adapter imports it after the first step, off that save's stall."""
    from megatron_ckpt_ext.backend import megatron_training

    (tmp_path / "mcx_first_save_stand_in.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(megatron_training, "FIRST_SAVE_IMPORTS",
                        ["mcx_first_save_stand_in", "mcx_no_such_module"])
    monkeypatch.delitem(sys.modules, "mcx_first_save_stand_in", raising=False)
    _train_step_stand_ins(mlm)
    mlm.mods["checkpointing"].get_args = lambda: argparse.Namespace(
        save="/ckpt", ckpt_format="torch_dist", no_save_rng=False, async_save=True)
    _install(mlm, async_save=True)
    mlm.mods["training"].train_step("fwd", "data", ["m"], "opt", "sched", "cfg", "fb")
    assert "mcx_first_save_stand_in" in sys.modules  # the missing one is skipped
    monkeypatch.delitem(sys.modules, "mcx_first_save_stand_in")
    assert megatron_training.import_first_save_modules(argparse.Namespace(async_save=False)) == []
    assert "mcx_first_save_stand_in" not in sys.modules  # a synchronous save imports nothing


@pytest.mark.parametrize("save", ["/ckpt", None])
def test_a_load_without_save_prepares_no_staging(mlm, save, monkeypatch):
    """Megatron-LM without ``--save`` (a resume into another layout to evaluate, say) never
    saves: the Checkpointer's load is told not to prepare the first save's staging, which would
    allocate and pin the state's bytes in /dev/shm beside the first training steps (a TP2 ->
    DP2 resume's first step took 3.8 s against stock's 1.2 s on two H200s); with ``--save`` the
    load prepares where nothing later does (here: the load's own switch)."""
    monkeypatch.setenv("MCX_PREPARE_AT_LOAD", "1")
    _train_step_stand_ins(mlm, save=save)
    made = _install(mlm, async_save=True)
    mlm.mods["checkpointing"].dist_checkpointing.load({}, "/ckpt/iter_0000005")
    assert made[0].prepare_at_load is (save is not None)


@pytest.mark.parametrize("case", ["default", "switch", "no_state_builder"])
def test_a_resumes_first_save_is_prepared_after_the_first_step_not_at_the_load(mlm, monkeypatch,
                                                                              case):
    """Where the first training step prepares the first save (Megatron's state builder found),
    the Checkpointer's load prepares nothing itself: its staging would be allocated and pinned
    beside the first step, whose own first allocations and kernel loads then wait for the
    driver (+0.6-0.9 s on an H200 at 134M). MCX_PREPARE_AT_LOAD=1 keeps the load's; a
    Megatron whose state the adapter cannot build keeps it too."""
    _train_step_stand_ins(mlm)
    if case == "switch":
        monkeypatch.setenv("MCX_PREPARE_AT_LOAD", "1")
    if case == "no_state_builder":
        del mlm.mods["checkpointing"].unwrap_model
    made = _install(mlm, async_save=True)
    mlm.mods["checkpointing"].dist_checkpointing.load({}, "/ckpt/iter_0000005")
    assert made[0].prepare_at_load is (case != "default")
    mlm.mods["training"].train_step("fwd", "data", ["m"], "opt", "sched", "cfg", "fb")
    assert len(made[0].prepared) == (0 if case == "no_state_builder" else 1)


@pytest.mark.parametrize("case", ["default", "switch", "prepare_at_load"])
def test_a_restored_snapshot_is_pinned_by_the_first_steps_prepare_by_default(
        mlm, monkeypatch, case):
    """By default the load leaves the pinning of a snapshot restored from memory to the
    staging's preparation after the first training step (prepare() pins it first); with
    MCX_PIN_ADOPTED=load, or where the load itself prepares, the load pins it as it returns."""
    _train_step_stand_ins(mlm)
    if case == "switch":
        monkeypatch.setenv("MCX_PIN_ADOPTED", "load")
    if case == "prepare_at_load":
        monkeypatch.setenv("MCX_PREPARE_AT_LOAD", "1")
    made = _install(mlm, async_save=True)
    mlm.mods["checkpointing"].dist_checkpointing.load({}, "/ckpt/iter_0000005")
    assert made[0].pin_at_load is (case != "default")
    mlm.mods["training"].train_step("fwd", "data", ["m"], "opt", "sched", "cfg", "fb")
    assert len(made[0].prepared) == 1


def test_the_first_train_step_prepares_nothing_without_save(mlm):
    built = _train_step_stand_ins(mlm, save=None)
    _install(mlm, async_save=True)
    mlm.mods["training"].train_step("fwd", "data", ["m"], "opt", "sched", "cfg", "fb")
    assert built == []


@pytest.mark.parametrize("load", ["/ckpt", None])
def test_setup_warms_the_restore_of_load_before_the_model_is_built(mlm, load):
    """Megatron's setup_model_and_optimizer builds the model, then loads --load: on entry the
    Checkpointer is asked to warm a restore of --load from this node's memory
    (prepare_restore), before Megatron's own setup runs; without --load nothing is asked."""
    made: list[FakeCheckpointer] = []
    mlm.mods["checkpointing"].get_args = lambda: argparse.Namespace(load=load, save="/ckpt")

    def setup_model_and_optimizer(model_provider_func, model_type, checkpointing_context=None):
        made[0].events.append("model built and loaded") if made else None
        return ("model", "optimizer", "scheduler")

    mlm.mods["training"].setup_model_and_optimizer = setup_model_and_optimizer
    megatron_lm.install(options=CkptOptions(async_save=True), modules=mlm.mods,
                        checkpointer_factory=lambda o: made.append(FakeCheckpointer(o)) or made[-1])
    assert mlm.mods["training"].setup_model_and_optimizer("provider", "encoder_or_decoder") == (
        "model", "optimizer", "scheduler")
    if load is None:
        assert made == [] or made[0].restores_prepared == []
    else:
        assert made[0].restores_prepared == [("/ckpt", [])]  # before Megatron's setup ran
        assert made[0].events == ["model built and loaded"]


def test_mcx_prepare_restore_0_leaves_the_restore_to_the_load(mlm, monkeypatch):
    made: list[FakeCheckpointer] = []
    mlm.mods["checkpointing"].get_args = lambda: argparse.Namespace(load="/ckpt", save="/ckpt")
    mlm.mods["training"].setup_model_and_optimizer = lambda *a, **k: ("m", "o", "s")
    monkeypatch.setenv("MCX_PREPARE_RESTORE", "0")
    megatron_lm.install(options=CkptOptions(async_save=True), modules=mlm.mods,
                        checkpointer_factory=lambda o: made.append(FakeCheckpointer(o)) or made[-1])
    assert mlm.mods["training"].setup_model_and_optimizer("provider", "t") == ("m", "o", "s")
    assert made and made[0].restores_prepared == []


def test_sync_save_is_committed_before_megatron_writes_its_tracker(mlm):
    made = _install(mlm, async_save=False)
    result = mlm.mods["checkpointing"].dist_checkpointing.save({}, "/ckpt/iter_0000003", None,
                                                               async_sharded_save=False)
    assert result is None  # Megatron's sync path asserts the request is None
    assert made[0].finalize_calls == [True]
    assert megatron_lm.reports()[0]["iteration"] == 3


def test_content_metadata_is_stored_where_megatron_core_would_store_it(mlm):
    _install(mlm, async_save=False)
    state: dict = {}
    mlm.mods["checkpointing"].dist_checkpointing.save(state, "/c/iter_0000001", None,
                                                      content_metadata={"distrib_optim": "x"})
    assert state[backend.mcore_content_metadata_key()] == {"distrib_optim": "x"}


def test_non_iteration_directories_go_to_stock_megatron_core(mlm):
    made = _install(mlm, async_save=True)
    out = mlm.mods["checkpointing"].dist_checkpointing.save({}, "/ckpt/release", None)
    assert out == "stock-save" and made == []


def test_load_of_an_iteration_goes_through_the_checkpointer(mlm):
    made = _install(mlm)
    dc = mlm.mods["checkpointing"].dist_checkpointing
    assert dc.load({"a": 1}, "/ckpt/iter_0000010", None, strict="assume_ok_unexpected") == {
        "loaded_by": "checkpointer"}
    assert made[0].loads == [("/ckpt", 10)]
    assert dc.check_is_distributed_checkpoint("/x") is True  # the rest is the real module


def test_load_with_a_non_default_strictness_stays_stock(mlm):
    _install(mlm)
    dc = mlm.mods["checkpointing"].dist_checkpointing
    assert dc.load({}, "/ckpt/iter_0000010", None, strict="raise_all") == {"loaded_by": "stock"}


def test_route_load_false_leaves_loads_stock(mlm):
    megatron_lm.install(options=CkptOptions(), route_load=False, modules=mlm.mods,
                        checkpointer_factory=FakeCheckpointer)
    assert mlm.mods["checkpointing"].dist_checkpointing.load({}, "/c/iter_0000002") == {
        "loaded_by": "stock"}


def test_uninstall_restores_every_patched_name(mlm):
    before = {(s, n): getattr(mlm.mods[s], n) for s, n in megatron_lm._PATCHES}
    _install(mlm, async_save=True)
    assert mlm.mods["training"].maybe_finalize_async_save is not before[("training",
                                                                         "maybe_finalize_async_save")]
    megatron_lm.uninstall()
    assert {(s, n): getattr(mlm.mods[s], n) for s, n in megatron_lm._PATCHES} == before


def test_megatrons_persistent_worker_is_replaced_by_an_early_checkpointer(mlm):
    made = _install(mlm, async_save=True, use_persistent_ckpt_worker=True)
    assert made == []  # nothing built at install (arguments not parsed, no process group yet)
    assert mlm.mods["initialize"].init_persistent_async_worker(0, "forkserver") is None
    assert mlm.mods["initialize"].init_persistent_async_worker is not mlm.mods[
        "async_utils"].init_persistent_async_worker
    # built in initialize_megatron (its worker warms up while the model is built), once
    assert len(made) == 1
    mlm.mods["checkpointing"].dist_checkpointing.save({}, "/ckpt/iter_0000003", None)
    assert len(made) == 1 and made[0].saves[0][2] == 3


def test_an_early_checkpointer_gets_the_data_parallel_group_once_megatron_has_built_it(mlm):
    # initialize_megatron calls init_persistent_async_worker before initialize_model_parallel:
    # asking mpu for the group then asserts in megatron-core 0.19.2 (seen on the H100).
    ready = [False]
    mpu = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: ready[0],
        get_data_parallel_group=lambda with_context_parallel: (
            "dp-cp-group" if ready[0] else pytest.fail("group asked for before it exists")))
    mlm.mods["checkpointing"].mpu = mpu
    made = _install(mlm, async_save=True, use_persistent_ckpt_worker=True)
    mlm.mods["initialize"].init_persistent_async_worker(0, "forkserver")
    assert made[0].dp_group is None
    ready[0] = True
    mlm.mods["checkpointing"].dist_checkpointing.save({}, "/ckpt/iter_0000003", None)
    assert made[0].dp_group == "dp-cp-group" and made[0].saves[0][2] == 3


def test_a_request_not_made_by_the_adapter_is_refused(mlm):
    _install(mlm, async_save=True)
    with pytest.raises(MegatronAdapterError, match="bypassed the adapter"):
        mlm.mods["checkpointing"].schedule_async_save(object())


def test_options_default_to_megatrons_parsed_args(mlm):
    args = argparse.Namespace(async_save=True, async_ckpt_use_cpu_shm=True,
                              ckpt_assume_constant_structure=True, dist_ckpt_workers=1)
    mlm.mods["checkpointing"].get_args = lambda: args
    made: list = []
    megatron_lm.install(modules=mlm.mods,
                        checkpointer_factory=lambda o: made.append(FakeCheckpointer(o)) or made[-1])
    mlm.mods["checkpointing"].dist_checkpointing.save({}, "/c/iter_0000001", None,
                                                      async_sharded_save=True)
    opts = made[0].options
    assert (opts.async_save, opts.async_ckpt_use_cpu_shm, opts.ckpt_assume_constant_structure) == (
        True, True, True)


def test_extra_args_provider_keeps_the_hosts_flag_and_installs(mlm, monkeypatch):
    installed: list[bool] = []
    monkeypatch.setattr(megatron_lm, "install", lambda: installed.append(True))
    parser = argparse.ArgumentParser()
    host = parser.add_argument("--async-save", action="store_true", default=None)
    assert megatron_lm.extra_args_provider(parser) is parser
    assert parser._option_string_actions["--async-save"] is host
    assert "--async-ckpt-use-cpu-shm" in parser._option_string_actions
    assert installed == [True]


def test_reports_match_every_checkpointers_records_by_iteration(monkeypatch):
    # Megatron's terminate closes the Checkpointer and a later save makes a new one: the reports
    # of both are kept and each lands on its own save, not on the first records in order.
    class Done:
        reports = [{"iteration": 16, "blocking_s": 1.5}]

    state = megatron_lm._state
    # iteration 9's save has no Checkpointer report (it failed): matching by position would
    # shift 16's report onto 9
    monkeypatch.setattr(state, "records", [{"iteration": i, "async": True} for i in (3, 6, 9, 16)])
    monkeypatch.setattr(state, "closed_reports", [{"iteration": 3, "blocking_s": 0.5},
                                                  {"iteration": 6, "blocking_s": 0.25}])
    monkeypatch.setattr(state, "checkpointer", Done())
    got = {r["iteration"]: r.get("checkpointer", {}).get("blocking_s")
           for r in megatron_lm.reports()}
    assert got == {3: 0.5, 6: 0.25, 9: None, 16: 1.5}


def test_a_directory_megatron_created_before_the_save_is_not_taken_for_a_committed_one(
        mlm, tmp_path, caplog):
    """Megatron-LM 0.19's save_checkpoint creates ``iter_N`` before it hands the save over: that
    empty directory is not a committed checkpoint, so no 'already committed' warning; a real
    re-save of a committed iteration still warns."""
    import logging

    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_ckpt_ext import Checkpointer

    megatron_lm.install(options=CkptOptions(), checkpointer_factory=Checkpointer,
                        modules=mlm.mods)
    ckpting = mlm.mods["checkpointing"]

    def megatron_saves(iteration):
        path = tmp_path / f"iter_{iteration:07d}"
        path.mkdir(exist_ok=True)  # as Megatron-LM does before calling dist_checkpointing.save
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0), replica_id=0)}
        ckpting.dist_checkpointing.save(state, str(path), None, async_sharded_save=False)

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # megatron-core's save needs a group; world 1
    try:
        with caplog.at_level(logging.WARNING):
            megatron_saves(5)
            megatron_saves(6)
            assert not [r for r in caplog.records if "already committed" in r.getMessage()]
            megatron_saves(5)  # iteration 5 is committed (it holds a manifest): replacing warns
        megatron_lm.uninstall()  # closes the Checkpointer while the group exists
    finally:
        dist.destroy_process_group()
    warned = [r.getMessage() for r in caplog.records if "already committed" in r.getMessage()]
    assert len(warned) == 1 and "iteration 5 " in warned[0]


def test_profile_saves_also_profiles_megatrons_whole_save_checkpoint(mlm, monkeypatch, tmp_path):
    """MCX_PROFILE_SAVES: Megatron's save_checkpoint (its state building around our save) runs
    under cProfile too, once per call, and uninstall puts Megatron's own back."""
    calls = []

    def save_checkpoint(iteration, model, *args, **kwargs):
        calls.append((iteration, model, kwargs))
        return "saved"

    training = mlm.mods["training"]
    training.save_checkpoint = save_checkpoint
    monkeypatch.setenv("MCX_PROFILE_SAVES", str(tmp_path))
    _install(mlm, async_save=True)
    assert training.save_checkpoint(7, "model", non_persistent_ckpt=False) == "saved"
    assert calls == [(7, "model", {"non_persistent_ckpt": False})]
    profile = (tmp_path / "save_profile_rank0.txt").read_text()
    assert profile.count("==== megatron save_checkpoint iteration 7") == 1, profile[:300]
    megatron_lm.uninstall()
    assert training.save_checkpoint is save_checkpoint


def test_profile_loads_profiles_megatrons_load_checkpoint(mlm, monkeypatch, tmp_path):
    """MCX_PROFILE_LOADS: Megatron's load_checkpoint runs under cProfile, its result and
    arguments passed through; uninstall puts Megatron's own back; unset: not wrapped."""
    def load_checkpoint(model, optimizer, scheduler, **kwargs):
        return (123, kwargs)

    training = mlm.mods["training"]
    training.load_checkpoint = load_checkpoint
    monkeypatch.delenv("MCX_PROFILE_LOADS", raising=False)
    _install(mlm, async_save=True)
    assert training.load_checkpoint is load_checkpoint
    megatron_lm.uninstall()
    monkeypatch.setenv("MCX_PROFILE_LOADS", str(tmp_path))
    _install(mlm, async_save=True)
    assert training.load_checkpoint("m", "o", "s", strict=False) == (123, {"strict": False})
    profile = (tmp_path / "load_profile_rank0.txt").read_text()
    assert profile.count("==== megatron load_checkpoint") == 1, profile[:300]
    megatron_lm.uninstall()
    assert training.load_checkpoint is load_checkpoint


@pytest.mark.parametrize("switch, inside", [(None, False), ("1", True)])
def test_megatrons_whole_save_checkpoint_runs_with_the_collector_paused(mlm, monkeypatch, switch,
                                                                         inside):
    """Megatron's state building around our save triggers the cyclic collector too: the
    launcher runs its save_checkpoint with the collector paused (MCX_GC_IN_SAVE=1: not)."""
    import gc

    seen = []

    def save_checkpoint(iteration, *args, **kwargs):
        seen.append(gc.isenabled())
        if iteration == 2:
            raise RuntimeError("Megatron's save failed")

    training = mlm.mods["training"]
    training.save_checkpoint = save_checkpoint
    monkeypatch.delenv("MCX_PROFILE_SAVES", raising=False)
    if switch is None:
        monkeypatch.delenv("MCX_GC_IN_SAVE", raising=False)
    else:
        monkeypatch.setenv("MCX_GC_IN_SAVE", switch)
    _install(mlm, async_save=True)
    training.save_checkpoint(1, "model")
    with pytest.raises(RuntimeError):
        training.save_checkpoint(2, "model")
    assert seen == [inside, inside] and gc.isenabled()
    megatron_lm.uninstall()
    assert training.save_checkpoint is save_checkpoint


def test_megatrons_save_checkpoint_stages_ahead_on_entry_and_gives_back_what_no_save_took(
        mlm, monkeypatch):
    """On entry to Megatron's save_checkpoint the launcher asks the Checkpointer to issue the
    last save's copies (save/ahead.py) while Megatron builds its state; on the way out, also on
    an error, what no save took is given back. Not for a non-persistent (local) checkpoint,
    which our save never sees."""
    calls = []

    class Ahead(FakeCheckpointer):
        def stage_ahead(self):
            calls.append("ahead")
            return True

        def drop_ahead(self):
            calls.append("drop")

    def save_checkpoint(iteration, *args, **kwargs):
        calls.append(f"megatron {iteration}")
        if iteration == 2:
            raise RuntimeError("Megatron's save failed")

    training = mlm.mods["training"]
    training.save_checkpoint = save_checkpoint
    megatron_lm.install(options=CkptOptions(async_save=True), checkpointer_factory=Ahead,
                        modules=mlm.mods)
    training.save_checkpoint(0, "model")  # no Checkpointer yet: nothing to stage ahead
    megatron_lm._state.get_checkpointer()
    training.save_checkpoint(1, "model")
    with pytest.raises(RuntimeError):
        training.save_checkpoint(2, "model")
    training.save_checkpoint(3, "model", non_persistent_ckpt=True)
    assert calls == ["megatron 0", "ahead", "megatron 1", "drop", "ahead", "megatron 2", "drop",
                     "megatron 3"]


def test_writer_trace_times_megatrons_whole_save_checkpoint_and_the_collectors_passes(
        mlm, monkeypatch, tmp_path):
    """MCX_WRITER_TRACE: one ``save_checkpoint`` event per call of Megatron's save_checkpoint
    (its whole body, the staging ahead on entry, the device wait after it), and a ``gc`` event
    for a collector pass in the trainer (a pass stops every thread: inside a timed save it
    shows there)."""
    import gc
    import json
    import time as _time

    from megatron_ckpt_ext import debug

    def save_checkpoint(iteration, *args, **kwargs):
        _time.sleep(0.02)

    training = mlm.mods["training"]
    training.save_checkpoint = save_checkpoint
    monkeypatch.delenv("MCX_PROFILE_SAVES", raising=False)
    monkeypatch.setenv("MCX_WRITER_TRACE", str(tmp_path))
    monkeypatch.setitem(debug._GC_TRACE, "folder", None)
    _install(mlm, async_save=True)
    try:
        training.save_checkpoint(3, "model")
        monkeypatch.setitem(debug._GC_TRACE, "min_s", 0.0)
        gc.collect()
    finally:
        megatron_lm.uninstall()
        gc.callbacks[:] = [c for c in gc.callbacks if c is not debug._gc_traced]
    events = [json.loads(line) for line in (tmp_path / debug.TRACE_FILE).read_text().splitlines()]
    windows = [e for e in events if e["what"] == "save_checkpoint"]
    assert len(windows) == 1 and windows[0]["body_s"] >= 0.02, windows
    assert {"ahead_s", "sync_after_s", "s"} <= set(windows[0])
    passes = [e for e in events if e["what"] == "gc"]
    assert passes and passes[-1]["generation"] == 2, passes


@pytest.mark.parametrize("cuda,switch", [(True, "1"), (False, "1"), (True, "build"),
                                         (True, "0")])
def test_the_restore_is_prepared_in_megatrons_initialisation_on_the_ranks_device(
        mlm, monkeypatch, cuda, switch):
    """With the persistent worker, initialize_megatron builds our Checkpointer seconds before the
    model build: there, on this rank's device (set as Megatron sets it: LOCAL_RANK), the restore
    of --load is prepared, and not again at the build. Without CUDA (or with
    MCX_PREPARE_RESTORE=build) it waits for the build; with MCX_PREPARE_RESTORE=0 nothing is
    prepared and no device set early."""
    import torch

    monkeypatch.setenv("MCX_PREPARE_RESTORE", switch)
    cuda_early = cuda and switch == "1"

    devices: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    mlm.mods["checkpointing"].get_args = lambda: argparse.Namespace(load="/ckpt", save="/ckpt",
                                                                    local_rank=1)
    mlm.mods["training"].setup_model_and_optimizer = lambda *a, **k: ("m", "o", "s")
    made = _install(mlm, async_save=True, use_persistent_ckpt_worker=True)
    mlm.mods["initialize"].init_persistent_async_worker(0, "forkserver")
    assert made[0].restores_prepared == ([("/ckpt", [])] if cuda_early else [])
    assert devices == ([1] if cuda_early else [])
    made[0].events.append("initialised")
    mlm.mods["training"].setup_model_and_optimizer("provider", "t")
    assert made[0].restores_prepared == ([] if switch == "0" else
                                         [("/ckpt", [] if cuda_early else ["initialised"])])
    # only the early preparation may copy the snapshot to the device by default
    assert made[0].prepared_early == ([] if switch == "0" else [cuda_early])


def test_no_device_is_set_early_for_a_rank_megatron_cannot_place(mlm, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d})"))
    mlm.mods["checkpointing"].get_args = lambda: argparse.Namespace(load="/ckpt", save="/ckpt",
                                                                    local_rank=3)
    made = _install(mlm, async_save=True, use_persistent_ckpt_worker=True)
    mlm.mods["initialize"].init_persistent_async_worker(0, "forkserver")
    assert made[0].restores_prepared == []
