"""The compat layer against the real installed backends (run three ways by .ci/compat_matrix.sh).

``MCE_EXPECT_NVRX`` (``0.4.1`` | ``0.7.0`` | ``none``) names the nvrx the matrix pass installed; when
unset, the detected version picks the expectation (and an unknown one skips: no table for it).
``MCE_EXPECT_MCORE`` likewise names the megatron-core (the "mcore main" pass: ``0.20.0+src``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_ckpt_ext import backend

ROOT = Path(__file__).resolve().parents[2]

# Every field backend.detect() reports, per backend, read from each release's own source (not
# from its version string, not from a run of detect()): a detection that changes fails here in
# the matrix pass of that backend, and docs/COMPAT.md is only regenerated after this table agrees.
# Environment facts, not backend capabilities: left out.
ENVIRONMENT = frozenset({"python_version", "torch_version", "cuda_available", "mcore_version",
                         "nvrx_version", "nvrx_error", "mcore_error"})
# Per nvrx pass ("none": nvrx hidden, megatron-core's own async_utils / filesystem_async provide
# the queue and the writer). Sources: nvidia_resiliency_ext/checkpointing/async_ckpt/{core,
# filesystem_async}.py of each release (0.4.1 installed, 0.7.0 unpacked by .ci/compat_matrix.sh),
# megatron/core/dist_checkpointing/strategies/{async_utils,filesystem_async}.py of 0.16.1.
EXPECTED: dict[str, dict[str, object]] = {
    "0.4.1": dict(
        async_provider="nvrx", nvrx_importable=True,
        queue_persistent=True, queue_cpu_shm_mode=False, queue_priorities=False,
        # AsyncCallsQueue has no warmup_persistent_caller: the worker starts at the first request
        warmup_persistent_caller=False, warmup_cpu_shm_mode=False,
        # FileSystemWriterAsync.__init__(path, *args, separation_hint=None, **kwargs) pops only
        # use_msc and forwards the rest to torch's FileSystemWriter
        writer_use_cpu_shm=False, writer_cached_structure=False, writer_multiproc_io=False,
        writer_use_msc=True,
        write_results_queue_mp_mode=False,  # _get_write_results_queue() takes no argument
        warmup_otel_bootstrap=False,  # no warmup_persistent_caller at all
        # PersistentAsyncCaller.async_loop never calls torch.cuda.set_device (no CUDA at start) ...
        worker_needs_cuda=False,
        # ... and neither it nor the queue takes a cpu_shm_mode: nothing to skip. This decides
        # fork vs spawn of the persistent worker (Checkpointer._make_queue ->
        # backend.persistent_worker_forks): False keeps spawn once CUDA is initialised.
        worker_cpu_shm_skips_cuda=False,
        # AsyncCaller.sync_all_async_calls: torch.tensor(..., device=torch.cuda.current_device())
        queue_sync_needs_cuda=True,
    ),
    "0.7.0": dict(
        async_provider="nvrx", nvrx_importable=True,
        # AsyncCallsQueue.__init__(persistent, is_daemon, cpu_priority, io_priority,
        # sigterm_timeout, cpu_shm_mode) behind an ObjectTracker metaclass
        queue_persistent=True, queue_cpu_shm_mode=True, queue_priorities=True,
        # AsyncCallsQueue.warmup_persistent_caller(cls, rank, ..., cpu_shm_mode=False)
        warmup_persistent_caller=True, warmup_cpu_shm_mode=True,
        writer_use_cpu_shm=True, writer_cached_structure=True, writer_multiproc_io=True,
        writer_use_msc=True,
        write_results_queue_mp_mode=True,  # get_write_results_queue(mp_mode='spawn')
        # warmup_persistent_caller(cls, rank, ..., cpu_shm_mode=False): no otel_bootstrap (which
        # Megatron-LM main's async_utils.init_persistent_async_worker passes where accepted)
        warmup_otel_bootstrap=False,
        # PersistentAsyncCaller.async_process_target: `if not cpu_shm_mode:` ...
        # torch.cuda.set_device(rank % torch.cuda.device_count()); torch.empty(1, device=cuda)
        worker_needs_cuda=True,
        # the same `if not cpu_shm_mode:`: with cpu_shm_mode=True the worker never touches CUDA,
        # so it is forked even after the trainer initialised CUDA (persistent_worker_forks)
        worker_cpu_shm_skips_cuda=True,
        # AsyncCaller.sync_all_async_calls: unchanged, on torch.cuda.current_device()
        queue_sync_needs_cuda=True,
    ),
    "none": dict(
        async_provider="mcore", nvrx_importable=False,
        # megatron-core 0.16.1 async_utils.AsyncCallsQueue.__init__(self, persistent=False)
        queue_persistent=True, queue_cpu_shm_mode=False, queue_priorities=False,
        warmup_persistent_caller=False, warmup_cpu_shm_mode=False,
        # filesystem_async.FileSystemWriterAsync.__init__(path, *args, separation_hint=None,
        # use_msc=False, **kwargs) forwards the rest to torch's FileSystemWriter;
        # _get_write_results_queue() takes no argument
        writer_use_cpu_shm=False, writer_cached_structure=False, writer_multiproc_io=False,
        writer_use_msc=True, write_results_queue_mp_mode=False,
        # AsyncCallsQueue.warmup_persistent_caller absent (and megatron-core main's own has no
        # otel_bootstrap either: strategies/async_utils.py)
        warmup_otel_bootstrap=False,
        # PersistentAsyncCaller.async_loop: torch.cuda.set_device(rank % device_count()), always
        worker_needs_cuda=True,
        # no cpu_shm_mode anywhere in async_utils: never skipped, never forked after CUDA init
        worker_cpu_shm_skips_cuda=False,
        queue_sync_needs_cuda=True,  # AsyncCaller.sync_all_async_calls on current_device()
    ),
}
# Per megatron-core release (the same in every nvrx pass; constraints/ci-py311.txt pins 0.16.1),
# and megatron-core main as its source tree reports itself (backend._imports._source_version).
MCORE_MAIN_VERSION = "0.20.0+src"
MCORE_EXPECTED: dict[str, dict[str, object]] = {
    "0.16.1": dict(
        mcore_dist_ckpt_importable=True, mcore_async_utils=True,
        # strategies/torch.py TorchDistSaveShardedStrategy.__init__(..., thread_count=2,
        # cached_metadata=False, ...): no cpu_shm_mode
        strategy_thread_count=True, strategy_cached_metadata=True, strategy_cpu_shm_mode=False,
        # strategies/torch.py TorchDistLoadShardedStrategy.__init__(self): no stream_ckpt_dequant;
        # MCoreLoadPlanner.__init__ sets self._intermediate_read_item_and_target = None
        load_strategy_stream_dequant=False, load_planner_single_stash=True,
        # strategies/fully_parallel.py FullyParallelLoadStrategyWrapper.__init__(strategy,
        # parallelization_group, do_cache_distribution, exchange_algo); the save wrapper's ends
        # at do_cache_distribution: no per_rank_object_load, no pg_cache_path/pg_cache_create
        load_wrapper_per_rank_objects=False, fully_parallel_pg_cache=False,
        # strategies/torch.py: `from .async_utils import AsyncRequest`: megatron-core's own class,
        # so with nvrx as the provider every request is converted (backend.adapt_async_request)
        strategy_request_provider="mcore",
        # the wheel ships no megatron/training and its megatron_fsdp has no experimental
        # fully_shard (distributed/fsdp/src/megatron_fsdp/fully_shard.py only)
        megatron_training=False, fsdp_symm_mem=False,
    ),
    # megatron-core main: Megatron-LM commit d98e8a6 (scripts/unpack_mcore_main.sh), a source
    # tree whose core/package_info.py says 0.20.0 ("+src": no dist-info, version read from that
    # file). Its package __init__ needs triton, absent here: the "mcore main" pass of
    # .ci/compat_matrix.sh imports megatron.core's subpackages through tests/compat/_mcore_source.
    # Files are megatron/core/dist_checkpointing/... of that commit.
    MCORE_MAIN_VERSION: dict(
        mcore_dist_ckpt_importable=True, mcore_async_utils=True,
        # strategies/torch.py TorchDistSaveShardedStrategy.__init__(backend, version,
        # keep_only_main_replica, thread_count=1, cached_metadata=False, separation_hint,
        # cpu_shm_mode=False)
        strategy_thread_count=True, strategy_cached_metadata=True, strategy_cpu_shm_mode=True,
        # strategies/torch.py TorchDistLoadShardedStrategy.__init__(self, cache_metadata=False,
        # checkpoint_name=None): stream_ckpt_dequant (core_r0.19.0) removed; MCoreLoadPlanner
        # is back to one self._intermediate_read_item_and_target (core_r0.19.0: a dict
        # _intermediate_read_items keyed by id(read_item))
        load_strategy_stream_dequant=False, load_planner_single_stash=True,
        # strategies/fully_parallel.py FullyParallelLoadStrategyWrapper.__init__(...,
        # per_rank_object_load=False, pg_cache_path=None, pg_cache_create=False);
        # FullyParallelSaveStrategyWrapper.__init__(..., validate_access_integrity=True,
        # pg_cache_path=None, pg_cache_create=False)
        load_wrapper_per_rank_objects=True, fully_parallel_pg_cache=True,
        # strategies/torch.py: `from .async_utils import AsyncRequest` (unchanged)
        strategy_request_provider="mcore",
        # megatron/training/ is in the tree (found, not importable here: it needs the whole
        # megatron.core, tests/compat/test_mcore_main.py reads its seams from the sources) ...
        megatron_training=True,
        # ... and distributed/fsdp/src/megatron_fsdp/experimental/fully_shard.py's fully_shard(
        # module, mesh, placements, mixed_precision_policy, grad_divisor) has no use_symm_mem
        # (here it does not import either: megatron.core.distributed needs triton)
        fsdp_symm_mem=False,
    ),
}


def _key() -> str:
    wanted = os.environ.get("MCE_EXPECT_NVRX")
    detected = backend.detect().nvrx_version or "none"
    if wanted:
        assert detected == wanted, f"matrix pass expects nvrx {wanted}, detected {detected}"
        return wanted
    if detected not in EXPECTED:
        pytest.skip(f"no expectations recorded for nvrx {detected}")
    return detected


def _env(*prepend: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, prepend), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _mcore_expected() -> dict[str, object]:
    version = backend.detect().mcore_version
    wanted = os.environ.get("MCE_EXPECT_MCORE")  # the megatron-core the matrix pass put first
    if wanted:
        assert version == wanted, f"matrix pass expects megatron-core {wanted}, detected {version}"
    if version not in MCORE_EXPECTED:
        if os.environ.get("MCE_EXPECT_NVRX"):  # the matrix runs the pinned megatron-core
            pytest.fail(f"megatron-core {version} here; the matrix expects one of "
                        f"{sorted(MCORE_EXPECTED)} (constraints/ci-py311.txt)")
        pytest.skip(f"no expectations recorded for megatron-core {version}")
    return MCORE_EXPECTED[version]


def _mismatches(expected: dict[str, object]) -> dict[str, str]:
    caps = backend.detect()
    return {name: f"detected {getattr(caps, name)!r}, the release's source says {want!r}"
            for name, want in expected.items() if getattr(caps, name) != want}


def test_every_detected_field_has_an_expectation_per_backend():
    # A field added to Capabilities without a value read from each release fails here.
    fields = {f.name for f in dataclasses.fields(backend.Capabilities)}
    for key, expected in EXPECTED.items():
        for version, mcore in MCORE_EXPECTED.items():
            assert not set(expected) & set(mcore)
            unpinned = fields - ENVIRONMENT - set(expected) - set(mcore)
            assert not unpinned, f"no expected value for {sorted(unpinned)} (nvrx {key}, mcore {version})"
            assert not (set(expected) | set(mcore)) - fields


def test_detected_features_match_the_installed_release():
    key = _key()
    wrong = _mismatches(EXPECTED[key])
    assert not wrong, (
        f"backend.detect() disagrees with nvrx {key}'s source: {wrong}. Re-read that release's "
        "source (see the comments of EXPECTED) before changing the expectation; do not regenerate "
        "docs/COMPAT.md to make a detection change pass.")


def test_detected_features_match_the_installed_megatron_core():
    _key()
    caps = backend.detect()
    assert caps.mcore_dist_ckpt_importable, caps.mcore_error
    wrong = _mismatches(_mcore_expected())
    assert not wrong, f"backend.detect() disagrees with megatron-core {caps.mcore_version}'s source: {wrong}"


def test_worker_start_method_follows_the_release(monkeypatch):
    # worker_cpu_shm_skips_cuda decides fork vs spawn of the persistent worker on a CUDA host
    # (Checkpointer._make_queue passes it as cpu_shm_mode to persistent_worker_forks): only nvrx
    # 0.7's worker, started with cpu_shm_mode=True, keeps CUDA out, so only it may be forked
    # after the trainer initialised CUDA. Simulated CUDA host, real queue of the real provider.
    import torch

    key = _key()
    caps = backend.detect()
    queue = backend.new_async_calls_queue(persistent=True)
    module = sys.modules[type(queue).__module__]  # the module whose mp starts the worker
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with backend.persistent_worker_forks(queue, cpu_shm_mode=caps.worker_cpu_shm_skips_cuda) as forks:
        method = module.mp.get_context("spawn").get_start_method()
    assert (forks, method) == {"0.4.1": (False, "spawn"), "0.7.0": (True, "fork"),
                               "none": (False, "spawn")}[key]


def test_old_and_new_nvrx_really_differ():
    # The table above must not describe two identical backends, else the matrix proves nothing.
    differing = {k for k in EXPECTED["0.4.1"] if EXPECTED["0.4.1"][k] != EXPECTED["0.7.0"].get(k)}
    assert {"queue_cpu_shm_mode", "queue_priorities", "writer_use_cpu_shm"} <= differing


def test_provider_queue_runs_the_strategy_request_type():
    caps = backend.detect()
    _key()
    strategy_module = backend.torch_dist_save_strategy_cls().__module__
    request_cls = getattr(sys.modules[strategy_module], "AsyncRequest")
    request = request_cls(print, ("a", "b"), [print], async_fn_kwargs={"x": 1}, preload_fn=None)
    adapted = backend.adapt_async_request(request)
    assert isinstance(adapted, backend.async_request_cls())
    assert adapted._asdict() == request._asdict()
    queue_module = backend.async_calls_queue_cls().__module__
    assert queue_module.startswith({"nvrx": "nvidia_resiliency_ext", "mcore": "megatron.core"}[caps.async_provider])
    assert backend.async_request_cls().__module__ == queue_module


def test_new_queue_gets_explicit_values():
    caps = backend.detect()
    _key()
    queue = backend.new_async_calls_queue(persistent=True, is_daemon=False,
                                          cpu_shm_mode=caps.queue_cpu_shm_mode)
    assert isinstance(queue, backend.async_calls_queue_cls())
    assert queue.persistent is True  # mcore's default is False, nvrx's True: never rely on it
    if caps.queue_cpu_shm_mode:
        assert queue.cpu_shm_mode is True and queue.is_daemon is False


def test_persistent_worker_verdict_matches_release():
    key = _key()
    caps = backend.detect()
    if caps.cuda_available:
        pytest.skip("the CPU verdicts below are about hosts without CUDA")
    plain, _ = backend.persistent_worker_runs_here(caps)
    shm, _ = backend.persistent_worker_runs_here(caps, cpu_shm_mode=True)
    assert (plain, shm) == {"0.4.1": (True, True), "0.7.0": (False, True), "none": (False, False)}[key]


def test_doctor_cli_runs_and_reports_cpu_shm(tmp_path):
    key = _key()
    r = subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", "doctor"], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ("not installed" if key == "none" else key) in r.stdout
    line = next(l for l in r.stdout.splitlines() if l.startswith("cpu_shm_staging"))
    assert ("available" if key == "0.7.0" else "fallback") in line


# A stand-in for megatron-core 0.19.2: its dist_checkpointing import runs the same nvrx version
# gate (strategies/torch.py -> has_nvrx_async_support -> assert nvrx.__version__ >= 0.6.0).
FAKE_MCORE_019 = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "from . import dist_checkpointing\n",
    "megatron/core/dist_checkpointing/__init__.py": "from .strategies import torch\n",
    "megatron/core/dist_checkpointing/strategies/__init__.py": "",
    "megatron/core/dist_checkpointing/strategies/torch.py":
        "from .nvrx import has_nvrx_async_support\nHAVE_NVRX = has_nvrx_async_support()\n",
    "megatron/core/dist_checkpointing/strategies/nvrx.py": textwrap.dedent("""
        from importlib import import_module
        def has_nvrx_async_support():
            try:
                import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.core")
            except ImportError:
                return False
            import nvidia_resiliency_ext as nvrx
            version = tuple(int(p) for p in str(nvrx.__version__).split(".")[:2])
            assert version >= (0, 6), "Minimum required nvidia-resiliency-ext package version is 0.6.0."
            return True
    """),
    "megatron_core-0.19.2.dist-info/METADATA": "Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.19.2\n",
}


def test_mcore_019_nvrx_trap(tmp_path):
    key = _key()
    for rel, text in FAKE_MCORE_019.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    r = subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", "doctor", "--json"],
                       cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    caps = data["capabilities"]
    assert caps["mcore_version"] == "0.19.2"
    if key == "0.4.1":
        assert caps["mcore_dist_ckpt_importable"] is False
        for needle in ("0.19.2", "0.4.1", "nvidia-resiliency-ext>=0.6.0", "pip uninstall"):
            assert needle in caps["mcore_error"]
        row = next(r for r in data["features"] if r["feature"] == "mcore_dist_ckpt")
        assert row["status"] == "missing"
    else:
        assert caps["mcore_dist_ckpt_importable"] is True, caps["mcore_error"]


def test_writer_clone_detection_matches_release():
    # nvrx 0.7's writer clones every CPU tensor of a request; our staged copies skip that clone
    # (backend.writer_keeps_snapshots). Older writers clone only views: nothing to skip.
    assert backend.writer_clones_cpu_tensors() is (_key() == "0.7.0")


def test_clone_is_skipped_only_for_snapshots_and_only_inside_the_block(monkeypatch):
    import torch

    monkeypatch.setattr(backend.async_queue, "writer_clones_cpu_tensors", lambda writer_cls=None: True)
    mine, other = torch.ones(4), torch.ones(4)
    with backend.writer_keeps_snapshots(lambda t: t.data_ptr() == mine.data_ptr()) as active:
        assert active
        assert mine.clone() is mine
        assert other.clone() is not other and torch.equal(other.clone(), other)
        assert mine.clone(memory_format=torch.contiguous_format) is not mine  # arguments: real
    assert mine.clone() is not mine  # restored
    monkeypatch.setenv("MCX_KEEP_WRITER_CLONES", "1")
    with backend.writer_keeps_snapshots(lambda t: True) as active:
        assert not active and mine.clone() is not mine


def test_host_preload_dropped_only_when_every_tensor_is_already_on_the_host(monkeypatch):
    # The real writer's preload (megatron-core's FileSystemWriterAsync.preload_tensors with
    # non_blocking=True) ends in torch.cuda.synchronize(): run in nvrx's persistent worker it
    # creates a CUDA context there. Our staged tensors are host tensors: the preload is dropped.
    from functools import partial

    import torch

    writer = backend.filesystem_writer_async_cls()
    request_cls = backend.async_request_cls()

    def request(tensor):
        buckets = [("__0_0.distcp", "__0_", ([], [(object(), tensor)]))]
        return request_cls(async_fn=print, async_fn_args=(0, buckets, None), finalize_fns=[],
                           preload_fn=partial(writer.preload_tensors, buckets, True))

    on_host = request(torch.ones(3))
    dropped = backend.without_host_preload(on_host)
    assert dropped.preload_fn is None and dropped.async_fn_args is on_host.async_fn_args
    elsewhere = request(torch.empty(3, device="meta"))  # stands for a device tensor
    assert backend.without_host_preload(elsewhere) is elsewhere
    monkeypatch.setenv("MCX_KEEP_PRELOAD", "1")
    assert backend.without_host_preload(on_host) is on_host
    monkeypatch.delenv("MCX_KEEP_PRELOAD")
    other = on_host._replace(preload_fn=partial(print, "x"))  # unknown preload: untouched
    assert backend.without_host_preload(other) is other


def test_write_results_queues_primed_for_every_writer_module():
    # Each writer module (megatron-core's, and nvrx 0.7's own) keeps a global results queue;
    # left lazy it is a Manager server spawned inside the first save. Primed at start-up: a
    # SpoolQueue each, no process.
    import multiprocessing as mp

    from megatron_ckpt_ext.spool import SpoolQueue

    backend.shutdown_write_results_queues()
    children = set(mp.active_children())
    assert backend.prime_write_results_queue() is True
    modules = [sys.modules[f"{backend.MCORE_STRATEGIES}.filesystem_async"]]
    nvrx_fs = sys.modules.get(f"{backend.NVRX_ASYNC}.filesystem_async")
    if _key() == "0.7.0":
        assert nvrx_fs is not None
    if nvrx_fs is not None and hasattr(nvrx_fs, "get_write_results_queue"):
        modules.append(nvrx_fs)
    queues = [module._results_queue for module in modules]
    try:
        assert all(q is not None for q in queues)
        assert len({id(q) for q in queues}) == len(queues)  # each module its own queue
        assert all(isinstance(q, SpoolQueue) for q in queues)
        assert set(mp.active_children()) == children  # no server process started
    finally:
        backend.shutdown_write_results_queues()
    assert all(module._results_queue is None for module in modules)
    assert not any(os.path.exists(q.directory) for q in queues)  # no stale results kept
