"""The checkpoint benchmark's pieces: the synthetic GPT state, host-memory sampling, and one runner
per save mode (stock megatron-core/nvrx, torch DCP, ours). Driven by ``benchmarks/bench_ckpt.py``.

Every runner has the same small lifecycle, which the driver times:

* ``unavailable()``: None, or why this mode cannot run with the installed backends (a skip);
* ``start(state)``: what a trainer does at start-up (queues, workers, staging buffers), timed as
  start-up cost, not as a save;
* ``save(state, root, iteration)``: the call a trainer makes; its wall time is the blocking time;
* ``wait_staged(timeout)``: until the state may be modified (only torch DCP's background stager
  returns before that; for every other mode this returns at once);
* ``wait_durable(iteration, polls, poll_s)``: until the checkpoint is finalized/committed, polled
  the way a trainer polls (``maybe_finalize(blocking=False)`` once per "iteration");
* ``close()``.
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ckpt_ext import Checkpointer, CkptOptions, _cpu_shim, backend
from megatron_ckpt_ext.save import write_path
from megatron_ckpt_ext.save.layout import TRACKER, checkpoint_name

__all__ = ["GptShape", "HostMemSampler", "MODES", "ModeSpec", "Peak", "build_state", "gpt_shape",
           "make_runner", "mutate", "state_bytes"]

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight + fp32 master param + Adam exp_avg + exp_avg_sq
SMOKE_SHAPE = (64, 2, 512)  # hidden, layers, vocab of the --cpu-smoke state (~1.8 MB per rank)


# -- modes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModeSpec:
    name: str
    source: str  # "megatron" | "torch_dcp" | "ours"
    worker: str  # "sync" | "temporal" | "persistent" | "thread" | "process"
    cpu_shm: bool = False
    constant_structure: bool = False
    stager: str | None = None  # torch DCP: None (default), "cached", "async"
    # the stock counterpart (same worker and staging) that this mode's ratios are taken against
    baseline: str | None = None


MODES: tuple[ModeSpec, ...] = (
    ModeSpec("megatron-sync", "megatron", "sync"),
    ModeSpec("megatron-async-temporal", "megatron", "temporal"),
    ModeSpec("megatron-async-persistent", "megatron", "persistent"),
    ModeSpec("megatron-async-persistent-cpu-shm", "megatron", "persistent", cpu_shm=True,
             constant_structure=True),
    ModeSpec("dcp-async-default", "torch_dcp", "thread"),
    ModeSpec("dcp-async-cached-stager", "torch_dcp", "thread", cpu_shm=True, stager="cached"),
    ModeSpec("dcp-async-process-async-stager", "torch_dcp", "process", cpu_shm=True,
             stager="async"),
    ModeSpec("ours-sync", "ours", "sync", baseline="megatron-sync"),
    ModeSpec("ours-async-persistent", "ours", "persistent", baseline="megatron-async-persistent"),
    ModeSpec("ours-async-persistent-cpu-shm", "ours", "persistent", cpu_shm=True,
             constant_structure=True, baseline="megatron-async-persistent-cpu-shm"),
    ModeSpec("ours-async-temporal", "ours", "temporal", baseline="megatron-async-temporal"),
    # a forked writer per save over the same cpu-shm staging: no request pickling or preload
    # hand-shake with a worker (measured ~0.5 s/save for the persistent worker on the H100)
    ModeSpec("ours-async-temporal-cpu-shm", "ours", "temporal", cpu_shm=True,
             constant_structure=True, baseline="megatron-async-persistent-cpu-shm"),
)


# -- synthetic state -----------------------------------------------------------------------------
@dataclass(frozen=True)
class GptShape:
    hidden: int
    layers: int
    vocab: int

    def weights(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, local shape) of a GPT's weights, Megatron-core names, one rank's shard."""
        h = self.hidden
        out: list[tuple[str, tuple[int, ...]]] = [("embedding.word_embeddings.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"decoder.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "input_layernorm.bias", (h,)),
                    (p + "self_attention.linear_qkv.weight", (3 * h, h)),
                    (p + "self_attention.linear_qkv.bias", (3 * h,)),
                    (p + "self_attention.linear_proj.weight", (h, h)),
                    (p + "self_attention.linear_proj.bias", (h,)),
                    (p + "pre_mlp_layernorm.weight", (h,)), (p + "pre_mlp_layernorm.bias", (h,)),
                    (p + "mlp.linear_fc1.weight", (4 * h, h)), (p + "mlp.linear_fc1.bias", (4 * h,)),
                    (p + "mlp.linear_fc2.weight", (h, 4 * h)), (p + "mlp.linear_fc2.bias", (h,))]
        out += [("decoder.final_layernorm.weight", (h,)), ("decoder.final_layernorm.bias", (h,))]
        return out

    def params(self) -> int:
        return sum(math.prod(s) for _, s in self.weights())


def gpt_shape(target_bytes: float) -> GptShape:
    """A GPT whose weights + fp32 master + Adam states come close to ``target_bytes`` per rank:
    the widest hidden size that still gives at least 4 layers, then as many layers as fit."""
    params = target_bytes / BYTES_PER_PARAM
    for hidden in (4096, 2048, 1024, 512, 256, 128, 64):
        vocab = 50304 if hidden >= 1024 else 8 * hidden
        per_layer = 12 * hidden * hidden + 13 * hidden
        if 4 * per_layer + vocab * hidden <= params or hidden == 64:
            layers = max(1, round((params - vocab * hidden) / per_layer))
            return GptShape(hidden, layers, vocab)
    raise AssertionError("unreachable")


def build_state(shape: GptShape, *, device: torch.device, rank: int) -> dict[str, torch.Tensor]:
    """Random (never zero) tensors: bf16 weights, fp32 master params, Adam exp_avg/exp_avg_sq."""
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    state: dict[str, torch.Tensor] = {}
    for name, local in shape.weights():
        master = torch.randn(local, generator=gen, device=device, dtype=torch.float32)
        state[f"model.{name}"] = master.to(torch.bfloat16)
        state[f"optimizer.fp32_param.{name}"] = master
        state[f"optimizer.exp_avg.{name}"] = torch.randn(local, generator=gen, device=device) * 1e-3
        state[f"optimizer.exp_avg_sq.{name}"] = torch.rand(local, generator=gen, device=device) + 1e-6
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def mutate(state: dict[str, torch.Tensor], step: int) -> None:
    """A training step's in-place change: every 7th tensor gets a scalar added (same storage, so
    the structure stays constant)."""
    for i, t in enumerate(state.values()):
        if i % 7 == step % 7:
            t.add_(1e-3 * step)


def sharded(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """megatron-core ShardedTensors: every tensor split along dim 0 across ranks (TP-like)."""
    st = backend.sharded_tensor_cls()
    return {k: st.from_rank_offsets(k, t, (0, rank, world)) for k, t in state.items()}


def time_threads(fn: Callable[[int], None], count: int) -> float:
    """Wall seconds for ``fn(0) .. fn(count - 1)``, each on its own thread, all started at once."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(count)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# -- host memory ---------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(c) for c in fh.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += _children(p)
    return tree


def smaps_rollup(pid: int, keys: tuple[str, ...] = ("Pss_Anon",)) -> dict[str, int]:
    """Bytes of the given ``/proc/<pid>/smaps_rollup`` fields ({} once the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def warm_up_default_group(device: torch.device) -> None:
    """One all-reduce on the default group, as a trainer's gradient all-reduces have done before
    its first checkpoint. NCCL creates its communicator at the first collective, and that holds
    host memory (+321 MB of anonymous memory measured on the H100 by
    benchmarks/probe_host_memory.py): without this, whichever mode runs first would be charged for it."""
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize()


def smaps_mappings(pid: int) -> dict[str, dict]:
    """Per mapping of ``/proc/<pid>/smaps``: name, size and its Pss_Anon (estimated: smaps has it
    only in the rollup, so Pss x Anonymous / Rss) / Private_Dirty / Anonymous bytes, keyed by
    start address ({} once the process is gone)."""
    out: dict[str, dict] = {}
    cur: dict | None = None
    try:
        with open(f"/proc/{pid}/smaps") as fh:
            for line in fh:
                head = line.split(None, 5)
                if "-" in head[0] and not head[0].endswith(":"):
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    name = head[5].strip() if len(head) > 5 else ""
                    cur = out[head[0].split("-")[0]] = {"name": name, "size": end - start,
                                                        "perms": head[1]}
                elif cur is not None and head[0] in ("Rss:", "Pss:", "Private_Dirty:", "Anonymous:"):
                    cur[head[0][:-1]] = int(head[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    for m in out.values():
        m["Pss_Anon"] = m.get("Pss", 0) * m.get("Anonymous", 0) // max(m.get("Rss", 0), 1)
    return out


def mapping_growth(before: dict[str, dict], after: dict[str, dict], key: str = "Pss_Anon",
                   top: int = 12) -> list[dict]:
    """The mappings whose ``key`` bytes grew most from ``before`` to ``after`` (new ones from 0),
    with the total growth over all mappings first: where a process's memory went."""
    rows = []
    for addr, m in after.items():
        grew = m.get(key, 0) - before.get(addr, {}).get(key, 0)
        if grew:
            rows.append({"addr": addr, "name": m["name"] or "[anon]", "size": m["size"],
                         "grew": grew, "new": addr not in before})
    gone = sum(m.get(key, 0) for a, m in before.items() if a not in after)
    rows.sort(key=lambda r: -r["grew"])
    return [{"total_grew": sum(r["grew"] for r in rows) - gone, "unmapped": gone}] + rows[:top]


def _pss_anon(pid: int) -> int:
    """Proportional anonymous memory of ``pid`` (forked children's shared pages counted once)."""
    return smaps_rollup(pid).get("Pss_Anon", 0)


def _shm_used(path: str = "/dev/shm") -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _sys_used() -> int:
    """MemTotal - MemAvailable: what the whole host holds (catches pinned cudaHostAlloc memory,
    which no per-process counter shows; noisy where other jobs run)."""
    info: dict[str, int] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


@dataclass
class Peak:
    """Peaks over baseline: ``proc`` = ``tree`` (this process tree's Pss_Anon) + ``shm``
    (/dev/shm, the host's: ranks of one host each see all of it), ``tree`` and ``shm`` its split
    at the sample where that sum peaked; ``sys`` the host's."""

    proc: int = 0
    sys: int = 0
    tree: int = 0
    shm: int = 0


class HostMemSampler:
    """Samples host memory held beyond a baseline, in a daemon thread.

    Process view: Pss_Anon of this process and all its descendants + /dev/shm usage, minus the
    same at :meth:`rebase`. System view: MemTotal - MemAvailable minus its baseline.
    :meth:`take_peak` returns the peaks since the previous call and resets them.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._base = (0, 0, 0)
        self._peak = Peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-mem", daemon=True)
        self.rebase()
        self._thread.start()

    def current(self) -> tuple[int, int, int]:
        """(process tree, /dev/shm, host) bytes beyond the baseline."""
        tree = sum(_pss_anon(p) for p in _process_tree(os.getpid()))
        return (tree - self._base[0], _shm_used() - self._base[1],
                _sys_used() - self._base[2])

    def rebase(self) -> None:
        with self._lock:
            self._base = (0, 0, 0)
            self._base = self.current()
            self._peak = Peak()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        tree, shm, sys_ = self.current()
        with self._lock:
            peak = self._peak
            if tree + shm >= peak.proc:  # the split of the peak, from one sample
                peak.proc, peak.tree, peak.shm = tree + shm, tree, shm
            peak.sys = max(peak.sys, sys_)

    def take_peak(self) -> Peak:
        self.sample()
        with self._lock:
            peak, self._peak = self._peak, Peak()
        return peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- runners -------------------------------------------------------------------------------------
def single_process_env() -> None:
    """Run as a plain script too: without torchrun's variables, a world of one on localhost
    (torchrun's own are kept)."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _poll(done: Callable[[], bool], polls: int, poll_s: float, what: str) -> None:
    """Call ``done()`` up to ``polls`` times, ``poll_s`` apart. The count (not a clock) bounds the
    wait, so every rank makes the same number of collective calls and gives up together."""
    for _ in range(polls):
        if done():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not finished after {polls} polls of {poll_s} s; raise "
                       "--durable-timeout-s if the disk is this slow")


def remove_checkpoint(root: Path, iteration: int) -> None:
    """Rank 0 deletes one checkpoint (keeps disk use bounded: at most two on disk)."""
    if _rank() == 0:
        shutil.rmtree(checkpoint_name(root, iteration), ignore_errors=True)


@dataclass
class Runner:
    spec: ModeSpec
    device: torch.device
    info: dict = field(default_factory=dict)  # recorded in the JSON with the mode's runs

    def unavailable(self) -> str | None:
        return None

    def start(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def save(self, state: dict[str, torch.Tensor], root: Path, iteration: int) -> None:
        raise NotImplementedError

    def wait_staged(self, timeout_s: float) -> None:
        pass

    def wait_durable(self, iteration: int, polls: int, poll_s: float) -> dict:
        return {}

    def verify(self, expected: dict[str, torch.Tensor], root: Path, iteration: int) -> bool | None:
        return None  # only our checkpoints are loaded back

    def close(self) -> None:
        pass


class MegatronRunner(Runner):
    """Stock megatron-core (+ nvrx) save, configured the way Megatron-LM 0.19's
    ``training/checkpointing.py`` and ``training/async_utils.py`` configure it:

    * strategy: ``TorchDistSaveShardedStrategy(cpu_shm_mode=--async-ckpt-use-cpu-shm)``; with
      ``--ckpt-assume-constant-structure`` ``use_cached_ckpt_structure=True`` and
      ``thread_count = --dist-ckpt-workers`` (1); wrapped in ``FullyParallelSaveStrategyWrapper``
      (``--ckpt-fully-parallel-save`` is Megatron's default); built at the first save and kept
      (Megatron's ``checkpointing_context``), access integrity validated at the first save only
      when the structure is assumed constant;
    * persistent worker: ``AsyncCallsQueue(persistent=True, cpu_shm_mode=...)``,
      ``warmup_persistent_caller(rank, cpu_priority=10, io_priority=3, cpu_shm_mode=...)`` (the
      Megatron defaults) and ``get_write_results_queue(mp_mode="fork")`` at start-up, as
      ``init_persistent_async_worker`` does; temporal: ``AsyncCallsQueue(persistent=False)``
      (Megatron-LM 0.19 itself turns --async-save off without the persistent worker; kept as the
      older releases' path);
    * a finalize function writes the tracker on rank 0 (Megatron's ``iter_finalize_fn``); a sync
      save ends with a barrier.
    """

    queue: Any = None
    strategy: Any = None

    def unavailable(self) -> str | None:
        caps = backend.detect()
        if not caps.mcore_dist_ckpt_importable:
            return f"megatron.core.dist_checkpointing unusable: {caps.mcore_error}"
        if self.spec.worker != "sync" and caps.async_provider == "sync":
            return f"no async backend ({caps.nvrx_error})"
        if self.spec.cpu_shm and not (caps.strategy_cpu_shm_mode and caps.queue_cpu_shm_mode):
            return (f"installed megatron-core {caps.mcore_version} / nvrx {caps.nvrx_version} have "
                    "no cpu_shm_mode (megatron-core >= 0.19 with nvrx >= 0.7 add it)")
        if self.spec.worker == "persistent":
            ok, reason = backend.persistent_worker_runs_here(caps, cpu_shm_mode=self.spec.cpu_shm)
            return None if ok else reason
        return None

    def start(self, state: dict[str, torch.Tensor]) -> None:
        if self.spec.worker == "sync":
            return
        cls = backend.async_calls_queue_cls()
        if self.spec.worker == "temporal":
            self.queue = backend.call_with_supported(cls, persistent=False)
            return
        self.queue = backend.call_with_supported(cls, persistent=True,
                                                 cpu_shm_mode=self.spec.cpu_shm)
        warmup = getattr(cls, "warmup_persistent_caller", None)
        if warmup is not None:
            backend.call_with_supported(warmup, _rank(), cpu_priority=10, io_priority=3,
                                        cpu_shm_mode=self.spec.cpu_shm)
        backend.get_write_results_queue(mp_mode="fork")
        self.info["stock_config"] = {"cpu_priority": 10, "io_priority": 3, "mp_mode": "fork"}

    def _strategy(self) -> tuple[Any, bool]:
        """(strategy, validate_access_integrity) for this save, as Megatron-LM picks them."""
        if self.strategy is not None:
            return self.strategy, not self.spec.constant_structure
        base = backend.call_with_supported(backend.torch_dist_save_strategy_cls(), "torch_dist", 1,
                                           cpu_shm_mode=self.spec.cpu_shm)
        if self.spec.constant_structure:
            base.use_cached_ckpt_structure = True
            base.thread_count = 1
        self.strategy = backend.call_with_supported(backend.fully_parallel_save_wrapper_cls(), base,
                                                    None, self.spec.constant_structure)
        return self.strategy, True

    def save(self, state: dict[str, torch.Tensor], root: Path, iteration: int) -> None:
        path = checkpoint_name(root, iteration)
        if _rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        strategy, validate = self._strategy()
        is_async = self.spec.worker != "sync"
        request = backend.call_with_supported(
            backend.dist_checkpointing().save, sharded(state, _rank(), _world()), str(path),
            strategy, async_sharded_save=is_async, validate_access_integrity=validate,
            async_strategy="nvrx" if is_async else "mcore")  # Megatron-LM: "mcore" when sync
        if not is_async:
            _write_tracker(root, iteration)
            dist.barrier()
            return
        request.add_finalize_fn(lambda: _write_tracker(root, iteration))
        if _cpu_shim.installed():
            # CPU-only torch: the stock preload/write functions call torch.cuda.synchronize() in
            # the (spawned) worker too; run them under the CPU shim there. No-op with CUDA.
            request = write_path.under_cpu_shim(request)
        self.queue.schedule_async_request(backend.adapt_async_request(request))

    def wait_durable(self, iteration: int, polls: int, poll_s: float) -> dict:
        if self.queue is not None:
            _poll(self._finalized, polls, poll_s, self.spec.name)
        return {}

    def _finalized(self) -> bool:
        """Megatron-LM's per-iteration maybe_finalize_async_save(blocking=False)."""
        self.queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
        return self.queue.get_num_unfinalized_calls() == 0

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        backend.shutdown_write_results_queues()
        self.strategy = None


def _write_tracker(root: Path, iteration: int) -> None:
    if _rank() == 0:
        (root / TRACKER).write_text(str(iteration))


class OursRunner(Runner):
    """Our Checkpointer; with cpu-shm, ``prepare()`` runs at start-up and the start-up time
    includes waiting for it and for the persistent worker's warm-up."""

    ck: Checkpointer | None = None

    def options(self) -> CkptOptions:
        s = self.spec
        return CkptOptions(async_save=s.worker != "sync",
                           use_persistent_ckpt_worker=s.worker == "persistent",
                           async_ckpt_use_cpu_shm=s.cpu_shm,
                           ckpt_assume_constant_structure=s.constant_structure)

    def start(self, state: dict[str, torch.Tensor]) -> None:
        self.ck = Checkpointer(self.options())
        self.info["options"] = {k: v for k, v in self.options().to_dict().items()
                                if k in ("async_save", "use_persistent_ckpt_worker",
                                         "async_ckpt_use_cpu_shm", "ckpt_assume_constant_structure",
                                         "dist_ckpt_workers")}
        t0 = time.perf_counter()
        self.ck.prepare(sharded(state, _rank(), _world()))
        self._wait_prepared(timeout_s=600)
        self.info["prepare_s"] = round(time.perf_counter() - t0, 6)
        t0 = time.perf_counter()
        _poll(self._warmed_up, 6000, 0.01, f"{self.spec.name} worker warm-up")
        self.info["worker_warmup_s"] = round(time.perf_counter() - t0, 6)
        self.info["startup_detail"] = dict(self.ck.startup)

    def _warmed_up(self) -> bool:
        # The persistent worker's warm-up request is finalized by maybe_finalize once it ran.
        self.ck.maybe_finalize()
        return self.ck.idle

    def _wait_prepared(self, timeout_s: float) -> None:
        # waited for here so the allocation is timed as start-up
        if not self.ck.wait_prepared(timeout_s):
            raise TimeoutError(f"{self.spec.name}: prepare() still allocating after "
                               f"{timeout_s:.0f} s")

    def save(self, state: dict[str, torch.Tensor], root: Path, iteration: int) -> None:
        self.ck.save(sharded(state, _rank(), _world()), root, iteration=iteration)

    def wait_durable(self, iteration: int, polls: int, poll_s: float) -> dict:
        _poll(lambda: self._committed(iteration), polls, poll_s, self.spec.name)
        return {"report": self._report(iteration)}

    def _committed(self, iteration: int) -> bool:
        # Done when the commit's report exists, not when maybe_finalize() names the iteration:
        # nvrx's queue returns the requests' own call_idx (always 0), so the Checkpointer's
        # return value misses every save but the first (fix proposed in the report).
        if self._report(iteration) is None:
            self.ck.maybe_finalize()
        return self._report(iteration) is not None

    def _report(self, iteration: int) -> dict | None:
        return next((r for r in self.ck.reports if r["iteration"] == iteration), None)

    def verify(self, expected: dict[str, torch.Tensor], root: Path, iteration: int) -> bool:
        like = {k: torch.zeros_like(v) for k, v in expected.items()}
        got = self.ck.load(sharded(like, _rank(), _world()), root, iteration=iteration)
        return all(torch.equal(got[k], v) for k, v in expected.items())

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
            self.ck = None


class DcpRunner(Runner):
    """torch.distributed.checkpoint.async_save over a gloo group (DCP requires a CPU backend).

    * ``dcp-async-default``: ``async_save(state, checkpoint_id=dir)``: torch's defaults (a thread
      executor; staging into fresh CPU memory on the caller's thread);
    * ``dcp-async-cached-stager``: a ``DefaultStager(StagingOptions(pinned, shared, sync staging,
      non-blocking copy))`` kept across saves, so its pinned shared buffers are reused (thread
      executor): the save returns once the state is staged;
    * ``dcp-async-process-async-stager``: the process executor and a background stager: the call
      returns at once and staging finishes later; the state must not change until then, so the
      driver waits for ``staging_completion`` before it mutates the state and records that time as
      ``staging_done_s``.
    """

    group: Any = None
    stager: Any = None
    pending: Any = None
    staging: Any = None

    def unavailable(self) -> str | None:
        import torch.distributed.checkpoint as dcp

        params = inspect.signature(dcp.async_save).parameters
        if self.spec.stager is None:
            return None
        from torch.distributed.checkpoint import staging

        if "async_stager" not in params or not hasattr(staging, "StagingOptions"):
            return f"torch {torch.__version__} has no async_stager / StagingOptions"
        if self.spec.worker == "process" and "async_checkpointer_type" not in params:
            return f"torch {torch.__version__} async_save has no process executor"
        return None

    def start(self, state: dict[str, torch.Tensor]) -> None:
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if self.spec.stager is None:
            return
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = self.device.type == "cuda"
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                 use_async_staging=self.spec.stager == "async",
                                 use_non_blocking_copy=cuda)
        self.stager = DefaultStager(options)
        self.info["staging_options"] = {k: getattr(options, k) for k in (
            "use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy")}

    def save(self, state: dict[str, torch.Tensor], root: Path, iteration: int) -> None:
        import torch.distributed.checkpoint as dcp

        kwargs: dict[str, Any] = {"checkpoint_id": str(checkpoint_name(root, iteration)),
                                  "process_group": self.group}
        if self.stager is not None:
            kwargs["async_stager"] = self.stager
        if self.spec.worker == "process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        rank = _rank()
        result = dcp.async_save({f"rank{rank}.{k}": v for k, v in state.items()}, **kwargs)
        self.staging = getattr(result, "staging_completion", None)
        self.pending = getattr(result, "upload_completion", result)

    def wait_staged(self, timeout_s: float) -> None:
        if self.staging is not None:
            self.staging.result(timeout=timeout_s)
            self.staging = None

    def wait_durable(self, iteration: int, polls: int, poll_s: float) -> dict:
        self.pending.result(timeout=polls * poll_s)
        self.pending = None
        return {}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.spec.worker == "process":
            _stop_dcp_process()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def _stop_dcp_process() -> None:
    """End torch DCP's checkpoint daemon process (a module global it keeps for the next save):
    dropping the reference runs its __del__, which asks it to terminate."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return
    if getattr(executor, "_CHECKPOINT_PROCESS", None) is not None:
        executor._CHECKPOINT_PROCESS = None
        import gc

        gc.collect()


_RUNNERS: dict[str, type[Runner]] = {"megatron": MegatronRunner, "ours": OursRunner,
                                     "torch_dcp": DcpRunner}


def make_runner(spec: ModeSpec, device: torch.device) -> Runner:
    return _RUNNERS[spec.source](spec, device)
