"""backend/ branches pinned with fake backend callables (old/new signatures, traps)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import pytest

from megatron_ckpt_ext import _runtime, backend, errors
from megatron_ckpt_ext.backend import detection, mcore


# -- fakes with the signatures real releases have ------------------------------------------------
class _Tracker(type):
    """Like nvrx 0.7's ObjectTracker: makes inspect.signature(cls) show (*args, **kwargs)."""

    def __call__(cls, *args, **kwargs):
        return super().__call__(*args, **kwargs)


class NewQueue(metaclass=_Tracker):
    def __init__(self, persistent: bool = True, is_daemon: bool = True, cpu_priority: int = 10,
                 io_priority: Optional[int] = None, cpu_shm_mode: bool = False):
        self.kwargs = dict(persistent=persistent, is_daemon=is_daemon, cpu_shm_mode=cpu_shm_mode)


class OldQueue:
    def __init__(self, persistent: bool = False):
        self.persistent = persistent


class BaseWriter:
    def __init__(self, path, single_file_per_rank: bool = True, thread_count: int = 1):
        self.thread_count = thread_count


class ForwardingWriter(BaseWriter):
    """Like nvrx 0.4 FileSystemWriterAsync: **kwargs go to the parent, one is popped."""

    def __init__(self, path, *args, separation_hint=None, **kwargs):
        self.use_msc = kwargs.pop("use_msc", False)
        super().__init__(path, *args, **kwargs)


def anything(**kwargs):
    return kwargs


def test_metaclass_trap_probes_init_not_class_signature():
    import inspect

    assert "cpu_shm_mode" not in inspect.signature(NewQueue).parameters  # the trap is real
    accepted, dropped = backend.accepted_kwargs(NewQueue, {"cpu_shm_mode": True, "bogus": 1})
    assert accepted == {"cpu_shm_mode": True} and dropped == {"bogus": 1}


def test_old_queue_drops_new_kwargs_and_keeps_explicit_persistent():
    q = backend.call_with_supported(OldQueue, persistent=True, cpu_shm_mode=True, is_daemon=False)
    assert q.persistent is True  # passed explicitly, not the old default False


def test_forwarding_kwargs_is_not_accept_anything():
    accepted, dropped = backend.accepted_kwargs(
        ForwardingWriter, {"use_msc": True, "thread_count": 2, "use_cpu_shm_for_gpu_tensors": True}
    )
    assert accepted == {"use_msc": True, "thread_count": 2}
    assert dropped == {"use_cpu_shm_for_gpu_tensors": True}


def test_plain_kwargs_callee_accepts_anything():
    assert backend.call_with_supported(anything, x=1, y=2) == {"x": 1, "y": 2}


def test_init_function_resolves_to_its_class():
    accepted, _ = backend.accepted_kwargs(ForwardingWriter.__init__, {"thread_count": 3, "zzz": 1})
    assert accepted == {"thread_count": 3}


class _Writer:
    """A per-save object whose bound methods the backend probes (a replayed save's writer)."""

    def __init__(self, payload):
        self.payload = payload

    def set_up(this, is_coordinator):  # noqa: N805  (the first parameter need not be "self")
        return is_coordinator

    def set_up_any(self, *args, **kwargs):
        return kwargs


def test_probing_a_bound_method_keeps_no_instance_alive():
    """A bound method is made anew at each attribute access and holds its instance: probing
    one must not keep it (the probe's cache once held 256 saves' writers, write buckets and
    all, in the trainer and in the persistent writer)."""
    import gc
    import weakref

    from megatron_ckpt_ext.backend.introspect import _takes

    alive = []
    for _ in range(5):
        writer = _Writer(payload=list(range(1000)))
        alive.append(weakref.ref(writer))
        assert _takes(writer.set_up, "is_coordinator")
        assert not _takes(writer.set_up, "this")  # the instance fills it: not a keyword
        assert backend.accepted_kwargs(writer.set_up, {"is_coordinator": 1, "x": 2}) == (
            {"is_coordinator": 1}, {"x": 2})
        assert _takes(writer.set_up_any, "anything")  # **kwargs kept as before
        del writer
    gc.collect()
    assert [r() for r in alive] == [None] * 5


# -- warn_once / rank -----------------------------------------------------------------------------
def test_warn_once_logs_once_per_key(caplog):
    caplog.set_level(logging.WARNING, logger="megatron_ckpt_ext._runtime")
    for _ in range(3):
        _runtime.warn_once("test-key-a", "message A")
    _runtime.warn_once("test-key-b", "message B")
    assert [r.getMessage() for r in caplog.records] == ["message A", "message B"]


def test_warn_once_silent_off_rank_zero(caplog, monkeypatch):
    monkeypatch.setattr(_runtime, "rank", lambda: 1)
    caplog.set_level(logging.WARNING, logger="megatron_ckpt_ext._runtime")
    _runtime.warn_once("test-key-rank1", "not on rank 1")
    assert caplog.records == []


def test_rank_is_zero_without_process_group():
    assert _runtime.rank() == 0


# -- detection ------------------------------------------------------------------------------------
def test_detect_is_cached_and_refreshable():
    first = backend.detect()
    assert backend.detect() is first
    assert backend.detect(refresh=True) is not first


def test_detect_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(detection, "_detect", boom)
    caps = backend.detect(refresh=True)
    try:
        assert caps.async_provider == "sync" and not caps.mcore_dist_ckpt_importable
        assert "probe exploded" in caps.mcore_error
    finally:
        monkeypatch.undo()
        backend.detect(refresh=True)


def test_mcore_019_nvrx_trap_message_names_both_fixes():
    msg = detection._explain_mcore_error(
        "AttributeError: module 'nvidia_resiliency_ext' has no attribute '__version__'",
        "0.19.2", "0.4.1")
    assert "0.19.2" in msg and "0.4.1" in msg
    assert "nvidia-resiliency-ext>=0.6.0" in msg and "pip uninstall nvidia-resiliency-ext" in msg


def test_other_mcore_import_errors_are_passed_through():
    msg = detection._explain_mcore_error("ImportError: no module named x", "0.16.1", "0.7.0")
    assert "pip uninstall" not in msg and "no module named x" in msg


# -- worker modes ---------------------------------------------------------------------------------
def _caps(**kw):
    return dataclasses.replace(backend.detect(), **kw)


@pytest.mark.parametrize(
    "kw, cpu_shm, runs",
    [
        (dict(cuda_available=True, worker_needs_cuda=True), False, True),
        (dict(cuda_available=False, worker_needs_cuda=False), False, True),  # nvrx 0.4 worker
        (dict(cuda_available=False, worker_needs_cuda=True, worker_cpu_shm_skips_cuda=False), True, False),
        (dict(cuda_available=False, worker_needs_cuda=True, worker_cpu_shm_skips_cuda=True,
              queue_cpu_shm_mode=True), True, True),  # nvrx 0.7 with cpu_shm_mode
        (dict(cuda_available=False, worker_needs_cuda=True, worker_cpu_shm_skips_cuda=True,
              queue_cpu_shm_mode=True), False, False),
    ],
)
def test_persistent_worker_runs_here(kw, cpu_shm, runs):
    caps = _caps(async_provider="nvrx", queue_persistent=True, **kw)
    ok, reason = backend.persistent_worker_runs_here(caps, cpu_shm_mode=cpu_shm)
    assert ok is runs, reason
    if not ok:
        assert "set_device" in reason


# Shaped like each release's source (tests/compat/test_real_backend.py checks the real ones in
# the compat matrix): the probes read the worker's and the agreement's code, not signatures.
class _Nvrx041:  # nvrx 0.4.1 core.py: the worker never touches CUDA and has no cpu_shm_mode
    class PersistentAsyncCaller:
        @staticmethod
        def async_loop(rank, queue, preload_q, comp_q, log_level=20):
            while True:
                item = queue.get()
                item.async_fn(*item.async_fn_args)

    class AsyncCaller:
        def sync_all_async_calls(self, is_alive):
            import torch

            return torch.tensor([is_alive], device=torch.cuda.current_device())


class _Nvrx070:  # nvrx 0.7.0 core.py: CUDA set up only without cpu_shm_mode
    class PersistentAsyncCaller:
        @staticmethod
        def async_process_target(rank, queue, cpu_shm_mode=False):
            import torch

            if not cpu_shm_mode:
                torch.cuda.set_device(rank % torch.cuda.device_count())

    AsyncCaller = _Nvrx041.AsyncCaller


class _Mcore0161:  # megatron-core 0.16.1 async_utils.py: CUDA set up unconditionally
    class PersistentAsyncCaller:
        @staticmethod
        def async_loop(rank, queue):
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())

    AsyncCaller = _Nvrx041.AsyncCaller


class _ShmButCuda:  # a worker that takes cpu_shm_mode yet sets up CUDA regardless: not skipped
    class PersistentAsyncCaller:
        @staticmethod
        def async_loop(rank, queue, cpu_shm_mode=False):
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
            return cpu_shm_mode

    AsyncCaller = _Nvrx041.AsyncCaller


@pytest.mark.parametrize("core, needs_cuda, shm_skips_cuda", [
    (_Nvrx041, False, False), (_Nvrx070, True, True), (_Mcore0161, True, False),
    (_ShmButCuda, True, False),
    (None, True, False),  # no provider: assume the worst (CUDA needed, never forked after init)
])
def test_worker_probes_read_the_worker_code(core, needs_cuda, shm_skips_cuda):
    # worker_cpu_shm_skips_cuda decides fork vs spawn of the persistent worker on a CUDA host.
    probes = detection._worker_probes(core)
    assert probes == {"worker_needs_cuda": needs_cuda, "worker_cpu_shm_skips_cuda": shm_skips_cuda,
                      "queue_sync_needs_cuda": True}


def test_no_persistent_worker_without_async_backend():
    ok, reason = backend.persistent_worker_runs_here(_caps(async_provider="sync", cuda_available=True))
    assert not ok and "sync" in reason


def test_dist_sync_needs_cuda_when_queue_allreduces_on_cuda():
    assert backend.dist_sync_runs_here(_caps(cuda_available=False, queue_sync_needs_cuda=True))[0] is False
    assert backend.dist_sync_runs_here(_caps(cuda_available=True, queue_sync_needs_cuda=True))[0] is True


def test_accessors_raise_actionable_error_when_mcore_unusable(monkeypatch):
    caps = _caps(mcore_dist_ckpt_importable=False, mcore_error="upgrade nvidia-resiliency-ext")
    monkeypatch.setattr(mcore, "detect", lambda **_: caps)
    with pytest.raises(errors.BackendUnavailable, match="upgrade nvidia-resiliency-ext"):
        backend.async_calls_queue_cls()
    with pytest.raises(ImportError):
        backend.dist_checkpointing()


def test_sync_provider_accessor_says_how_to_enable_async(monkeypatch):
    caps = _caps(async_provider="sync", nvrx_error="not installed")
    monkeypatch.setattr(mcore, "detect", lambda **_: caps)
    with pytest.raises(errors.BackendUnavailable, match="pip install"):
        backend.async_request_cls()


def test_map_sharded_tensors_replaces_nested_in_place():
    st = backend.sharded_tensor_cls()
    import torch

    t = st.from_rank_offsets("a", torch.zeros(2))
    tree = {"x": [t, 3, {"y": t}], "z": "keep"}
    backend.map_sharded_tensors(tree, lambda s: ("seen", s.key))
    assert tree == {"x": [("seen", "a"), 3, {"y": ("seen", "a")}], "z": "keep"}


def test_nvrx_temporal_deprecation_warning_passes_once_on_rank_0_and_nothing_else_is_dropped(
        caplog):
    """nvrx logs it at every temporal save on every rank; after a temporal queue is made, only
    the first reaches the log (rank 0 here: no process group), other records of that logger do."""
    from megatron_ckpt_ext.backend import async_queue

    nvrx = logging.getLogger(async_queue._NVRX_QUEUE_LOGGER)
    backend.new_async_calls_queue(persistent=False)
    backend.new_async_calls_queue(persistent=False)  # installs one filter, not two
    assert sum(isinstance(f, async_queue._FirstOnRankZero) for f in nvrx.filters) == 1
    with caplog.at_level(logging.WARNING, logger=async_queue._NVRX_QUEUE_LOGGER):
        for f in nvrx.filters:  # a fresh state for this test
            if isinstance(f, async_queue._FirstOnRankZero):
                f.passed = False
        for _ in range(3):
            nvrx.warning("The TemporalAsyncCaller will be deprecated soon. ")
        nvrx.warning("something else")
    texts = [r.getMessage() for r in caplog.records if r.name == async_queue._NVRX_QUEUE_LOGGER]
    assert texts == ["The TemporalAsyncCaller will be deprecated soon. ", "something else"], texts


def test_megatron_cores_version_check_is_cached_while_planning_and_restored_after():
    import megatron.core.utils as mutils

    original = mutils.is_torch_min_version
    calls: list = []

    def counting(version, check_equality=True):
        calls.append((version, check_equality))
        return original(version, check_equality)

    mutils.is_torch_min_version = counting
    try:
        with backend.version_checks_cached():
            answers = {mutils.is_torch_min_version("2.6a0") for _ in range(100)}
            answers |= {mutils.is_torch_min_version("2.6a0", check_equality=False)}
            with backend.version_checks_cached():  # nested: the cache stays, not wrapped twice
                mutils.is_torch_min_version("2.6a0")
        assert calls == [("2.6a0", True), ("2.6a0", False)]  # each distinct question once
        assert answers <= {True, False} and mutils.is_torch_min_version is counting
    finally:
        mutils.is_torch_min_version = original


def test_object_collectives_redirect_only_this_threads_default_group_calls(monkeypatch):
    """backend.object_collectives_on: a call for the default group (no group, or group=None) on
    the planning thread goes to the host group; a group the caller names (by keyword or by
    position), another thread's call and any call after the block are left as they were."""
    import threading

    import torch.distributed as dist

    calls = []

    def all_gather_object(object_list, obj, group=None):
        calls.append(group)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    host = object()
    with backend.object_collectives_on(host):
        dist.all_gather_object([], 1)
        dist.all_gather_object([], 1, group=None)
        dist.all_gather_object([], 1, "theirs")
        dist.all_gather_object([], 1, group="theirs")
        other = threading.Thread(target=dist.all_gather_object, args=([], 1))
        other.start()
        other.join()
    dist.all_gather_object([], 1)
    assert calls == [host, host, "theirs", "theirs", None, None]
    with backend.object_collectives_on(None):  # no host group: nothing changes
        dist.all_gather_object([], 1)
    assert calls[-1] is None and dist.all_gather_object is all_gather_object


def test_call_arguments_names_a_calls_parameters_and_survives_a_wider_decorator():
    """What a call passed, by parameter name; a call its signature refuses (a decorator that
    takes more than the signature shows, as torch's ``_api_bc_check``) gives its keywords."""
    import functools

    def inner(state_dict, *, reader=None, no_dist=False):
        return no_dist

    @functools.wraps(inner)
    def wider(*args, **kwargs):
        if len(args) == 2:
            kwargs["reader"] = args[1]
            args = args[:1]
        return inner(*args, **kwargs)

    arguments = backend.call_arguments(wider)
    assert arguments({"a": 1}, reader="r") == {"state_dict": {"a": 1}, "reader": "r"}
    assert arguments({"a": 1}, "r", no_dist=True) == {"no_dist": True}
