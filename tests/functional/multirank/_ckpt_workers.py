"""Rank bodies for the checkpointer tests (a module of its own so spawned ranks can import them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save.layout import read_tracker
from megatron_ckpt_ext.staging import ShmStager

from tests._support.dist import device, sharded

# The two async writers a training loop meets: one forked per save, and the persistent worker
# with shared-memory staging of a constant structure (test_close_after_error, test_suspend).
ASYNC_MODES = {
    "temporal": {"async_save": True},
    "persistent-cpu-shm": {"async_save": True, "use_persistent_ckpt_worker": True,
                           "async_ckpt_use_cpu_shm": True,
                           "ckpt_assume_constant_structure": True},
}


def step_state(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Distinct values per step and rank; a mix of shapes and dtypes; on the test device."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    state = {"w": torch.randn(64, 8, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16),
             "step": torch.full((4,), step, dtype=torch.int64)}
    return {k: v.to(device()) for k, v in state.items()}


def load_back(ck: Checkpointer, rank: int, world: int, root: str, iteration: int | None) -> dict:
    like = {k: torch.zeros_like(v) for k, v in step_state(0, rank).items()}
    return ck.load(sharded(rank, world, like), root, iteration=iteration)


def assert_equal(got: dict, want: dict, what: str) -> None:
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: tensor {k!r} differs"


def roundtrip(rank: int, world: int, root: str, options: dict, saves: int) -> None:
    """``saves`` consecutive saves; after each save() returns the live tensors are overwritten in
    place; every checkpoint must hold exactly its own step's values."""
    live = step_state(0, rank)
    with Checkpointer(CkptOptions(**options)) as ck:
        ck.prepare(sharded(rank, world, live))  # staging buffers in the background (cpu-shm)
        for step in range(1, saves + 1):
            for k, v in step_state(step, rank).items():
                live[k].copy_(v)  # same storage every step (constant structure)
            ck.save(sharded(rank, world, live), root, iteration=step)
            for v in live.values():
                v.fill_(-7)  # mutate right after save() returned
            ck.maybe_finalize()
        ck.maybe_finalize(blocking=True)
        assert read_tracker(root) == saves
        assert_written_pages_dropped(root)
        torch.distributed.barrier()  # no rank loads (reading pages back) before all have checked
        for step in range(1, saves + 1):
            assert_equal(load_back(ck, rank, world, root, step), step_state(step, rank), f"iteration {step}")
        assert_equal(load_back(ck, rank, world, root, None), step_state(saves, rank), "tracker load")
        check_reports(ck.reports, rank, world, root, saves, async_save=options.get("async_save", False))


def assert_written_pages_dropped(root: str) -> None:
    """Every committed data file left the page cache once written (the writer drops its pages)."""
    from tests._support.pagecache import can_drop_pages, resident_pages

    if not can_drop_pages(root):
        return
    cached = {str(p): resident_pages(str(p)) for p in Path(root).glob("iter_*/*.distcp")}
    assert cached and not any(cached.values()), cached


def check_reports(reports: list[dict], rank: int, world: int, root: str, saves: int, *,
                  async_save: bool) -> None:
    """The per-save report: one entry per save, sizes exact, times consistent, file on rank 0."""
    import json

    nbytes = sum(v.numel() * v.element_size() for v in step_state(0, rank).values())
    assert [r["iteration"] for r in reports] == list(range(1, saves + 1))
    for r in reports:
        assert (r["bytes"], r["bytes_total"], r["world"]) == (nbytes, nbytes * world, world), r
        assert r["host_extra_bytes"] == (nbytes if async_save else 0), r
        assert 0 < r["blocking_s"] <= r["durable_s"] + 1e-6, r
        assert max(r["phases"].values()) <= r["durable_s"] + 1e-6, r  # each phase: max over ranks
        assert r["write_gbps"] > 0 and (r["staging_gbps"] is None) == (not async_save), r
    if rank == 0:
        lines = (Path(root) / "ckpt_report.jsonl").read_text().splitlines()
        assert [json.loads(line)["iteration"] for line in lines] == list(range(1, saves + 1))


def count_forks_during_sync_save(rank: int, world: int, root: str, options: dict, out: str) -> None:
    """Count os.fork calls made while a synchronous save runs (forked writers use os.fork)."""
    forks = []
    real_fork = os.fork

    def counting_fork():
        forks.append(1)
        return real_fork()

    with Checkpointer(CkptOptions(**options)) as ck:
        os.fork = counting_fork
        try:
            ck.save(sharded(rank, world, step_state(1, rank)), root, iteration=1)
        finally:
            os.fork = real_fork
    Path(out, f"forks{rank}").write_text(str(len(forks)))


def crash_before_commit(rank: int, world: int, root: str, options: dict) -> None:
    """Save 1 commits; save 2 fails just before its commit (a hook raising there): the tracker
    stays at 1 and load returns iteration 1."""
    from megatron_ckpt_ext.hooks import SaveHooks

    class Boom(SaveHooks):
        def at(self, point, record):
            if point == "before_commit" and record.iteration == 2:
                raise RuntimeError("injected failure before commit")

    with Checkpointer(CkptOptions(**options), hooks=Boom()) as ck:
        ck.save(sharded(rank, world, step_state(1, rank)), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        try:
            ck.save(sharded(rank, world, step_state(2, rank)), root, iteration=2)
            ck.maybe_finalize(blocking=True)
        except RuntimeError as e:
            assert "injected" in str(e)
        else:
            raise AssertionError("the injected failure did not surface")
    assert read_tracker(root) == 1
    assert Path(root, "iter_0000002.incomplete").exists() and not Path(root, "iter_0000002").exists()
    with Checkpointer(CkptOptions()) as fresh:
        assert_equal(load_back(fresh, rank, world, root, None), step_state(1, rank), "after crash")


def save_for_interop(rank: int, world: int, root: str, options: dict) -> None:
    with Checkpointer(CkptOptions(**options)) as ck:
        ck.save(sharded(rank, world, step_state(3, rank)), root, iteration=3)


def stock_load(rank: int, world: int, root: str) -> None:
    """megatron-core alone (no plugin object involved) loads the committed directory."""
    from megatron.core import dist_checkpointing

    from megatron_ckpt_ext import _cpu_shim

    _cpu_shim.install()  # CPU-only torch: stock megatron-core calls torch.cuda on its load path too
    like = {k: torch.zeros_like(v) for k, v in step_state(0, rank).items()}
    got = dist_checkpointing.load(sharded(rank, world, like), str(Path(root, "iter_0000003")))
    assert_equal(got, step_state(3, rank), "stock megatron-core load")


def close_cleans_up(rank: int, world: int, root: str, options: dict, out: str) -> None:
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    ck = Checkpointer(CkptOptions(**options))
    ck.save(sharded(rank, world, step_state(1, rank)), root, iteration=1)
    ck.close()
    ck.close()  # idempotent
    gone, alive = psutil.wait_procs([p for p in me.children(recursive=True) if p.pid not in before], timeout=10)
    Path(out, f"alive{rank}").write_text(" ".join(f"{p.pid}:{p.name()}" for p in alive))


def trial_state(step: int, rank: int, keys: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    shapes = {"a": (128,), "b": (16, 16), "c": (33,), "new": (5, 3)}
    return {k: torch.randn(shapes[k], generator=g).to(device()) for k in keys}


def stale_and_dirty_trial(rank: int, world: int, root: str, options: dict, saves: int) -> None:
    """The staging trials through the Checkpointer (issue 5). Between saves: values change in
    place, some tensors are reallocated (same shape, new storage), once an entry is added. After
    each save() returns, the sources are overwritten and freed and same-size tensors allocated
    (provoking buffer reuse). Every checkpoint must load back exactly its own step's state."""
    keys = ["a", "b", "c"]
    live = trial_state(0, rank, keys)
    expected = {}
    with Checkpointer(CkptOptions(**options)) as ck:
        for step in range(1, saves + 1):
            if step == 5:
                keys = keys + ["new"]
            want = trial_state(step, rank, keys)
            for k in keys:
                if k not in live or step % 3 == 0 and k == "b":
                    live[k] = torch.empty_like(want[k])  # reallocated / new
                live[k].copy_(want[k])
            expected[step] = dict(want)
            ck.save(sharded(rank, world, live), root, iteration=step)
            for v in live.values():
                v.fill_(float("nan"))  # dirty: overwrite, then free and allocate same sizes
            live = {k: torch.empty_like(v).fill_(123.0) for k, v in live.items()}
            ck.maybe_finalize()
        ck.maybe_finalize(blocking=True)
        for step, want in expected.items():
            like = {k: torch.zeros_like(v) for k, v in want.items()}
            got = ck.load(sharded(rank, world, like), root, iteration=step)
            assert_equal(got, want, f"trial iteration {step}")


def worker_cuda_contexts(rank: int, world: int, root: str, options: dict, out: str) -> None:
    """GPU only: after a persistent-worker save, which of this rank's child processes hold a CUDA
    context (nvidia-smi's compute apps)? Written to ``out/ctx{rank}`` as 'children|with_ctx'."""
    import subprocess

    import psutil

    with Checkpointer(CkptOptions(**options)) as ck:
        ck.save(sharded(rank, world, step_state(1, rank)), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        children = {p.pid for p in psutil.Process().children(recursive=True)}
        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        with_ctx = {int(x) for x in smi.split()} & children
    Path(out, f"ctx{rank}").write_text(f"{sorted(children)}|{sorted(with_ctx)}")


def replicated_fully_parallel_load(rank: int, world: int, root: str) -> None:
    """A tensor replicated on every rank (like a data-parallel model): saved once, and with
    fully-parallel load each rank reads a part and the shards are exchanged between ranks."""
    from megatron.core.dist_checkpointing import ShardedTensor

    weight = torch.arange(4096, dtype=torch.float32).reshape(64, 64).to(device())
    bias = torch.arange(64, dtype=torch.float32).to(device())
    make = lambda w, b: {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=rank),
                         "b": ShardedTensor.from_rank_offsets("b", b, replica_id=rank)}
    with Checkpointer(CkptOptions(async_save=True, ckpt_fully_parallel_load=True)) as ck:
        ck.save(make(weight, bias), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        got = ck.load(make(torch.zeros_like(weight), torch.zeros_like(bias)), root)
    assert torch.equal(got["w"], weight) and torch.equal(got["b"], bias)


def unwritable_root(rank: int, world: int, root: str, options: dict) -> None:
    """The root lies under a regular file: rank 0 cannot create it. Every rank must raise
    CheckpointWriteError naming the path (no rank left waiting), and nothing is created."""
    from megatron_ckpt_ext.errors import CheckpointWriteError

    blocker = Path(root).parent
    if rank == 0:
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("a regular file\n")
    torch.distributed.barrier()
    ck = Checkpointer(CkptOptions(**options))
    try:
        ck.save(sharded(rank, world, step_state(1, rank)), root, iteration=1)
    except CheckpointWriteError as e:
        assert f"cannot create {root}/iter_0000001.incomplete on rank 0" in str(e), str(e)
        assert "(--save)" in str(e) and ("NotADirectoryError" in str(e) or rank != 0), str(e)
    else:
        raise AssertionError(f"rank {rank}: save under a regular file did not raise")
    finally:
        ck.close()
    assert blocker.is_file()


def save_and_verify(ck: Checkpointer, rank: int, world: int, root: str, steps: Any, *,
                    on_save: Any = None) -> None:
    """Save each step's values (same storage every step), overwrite them as soon as save()
    returns, finalize; then every checkpoint must load back exactly its own step's values."""
    live = step_state(0, rank)
    for step in steps:
        if on_save is not None:
            on_save(step)
        for k, v in step_state(step, rank).items():
            live[k].copy_(v)
        ck.save(sharded(rank, world, live), root, iteration=step)
        for v in live.values():
            v.fill_(-7)
        ck.maybe_finalize(blocking=True)
    for step in steps:
        assert_equal(load_back(ck, rank, world, root, step), step_state(step, rank), f"it {step}")


def copy_wait_order(rank: int, world: int, root: str, options: dict, keep_clones: bool) -> None:
    """Record the order of planning (megatron-core's save), the wait for the staged copies and
    the hand-over to the writer, for two saves; the checkpoints must still load bit-exact."""
    from megatron_ckpt_ext import backend
    from megatron_ckpt_ext.hooks import SaveHooks

    events: list[str] = []
    names = {"planned": "plan", "copies_landed": "wait", "scheduled": "schedule"}

    class Order(SaveHooks):
        def at(self, point, record):
            if point in names:
                events.append(names[point])

    if keep_clones:  # a writer that clones every CPU tensor while planning, clones kept
        os.environ["MCX_KEEP_WRITER_CLONES"] = "1"
        backend.writer_clones_cpu_tensors = lambda *a: True
    with Checkpointer(CkptOptions(**options), hooks=Order()) as ck:
        save_and_verify(ck, rank, world, root, (1, 2), on_save=lambda s: events.append(f"save{s}"))
        assert all("copy_wait_s" in r["phases"] for r in ck.reports), ck.reports
    for step in (1, 2):
        mine = events[events.index(f"save{step}"):]
        first = {e: mine.index(e) for e in ("plan", "wait", "schedule")}
        if keep_clones:  # the clone reads the bytes: wait before planning
            assert first["wait"] < first["plan"] < first["schedule"], events
        else:  # plan and hand over while the copies run, then wait (and publish)
            assert first["plan"] < first["schedule"] < first["wait"], events


class _LateCopies:
    """Stands for a copy stream's events: the copies land only when synchronize() is called."""

    def __init__(self, pairs: list, delay_s: float) -> None:
        self.pairs, self.delay_s = pairs, delay_s
        self.start = self.end = self

    def synchronize(self) -> None:
        import time

        time.sleep(self.delay_s)
        for dst, src in self.pairs:
            dst.copy_(src)

    def elapsed_time(self, other: object) -> float:
        return self.delay_s * 1e3

    def order_before_current_stream(self) -> None:  # no stream on CPU: the host waits
        self.synchronize()


def shm_stager(cls: type[ShmStager], rank: int, options: dict, **kwargs: Any) -> ShmStager:
    """A test's ShmStager subclass built as the Checkpointer's own would be for ``options``,
    to pass as ``Checkpointer(stager=...)``."""
    return cls(job_id=str(os.getppid()), rank=rank,
               reuse=bool(options.get("ckpt_assume_constant_structure")), **kwargs)


def _garbage_until_copied(staged: list, tensors: Any) -> list:
    """Simulated device copies: the staged buffers hold garbage; the (buffer, source clone)
    pairs are what landing the copies writes."""
    pairs = [(d, s.detach().clone()) for d, s in zip(staged, tensors)]
    for d in staged:
        d.fill_(-999)
    return pairs


class _LateShm(ShmStager):
    """Its copies land only when the trainer waits for them, 0.3 s later (:class:`_LateCopies`)."""

    def _copy(self, staged, tensors):  # type: ignore[no-untyped-def]
        return [_LateCopies(_garbage_until_copied(staged, tensors), 0.3)]


def late_copies_roundtrip(rank: int, world: int, root: str, options: dict, saves: int) -> None:
    """Device copies simulated on CPU: each save's staged buffers hold garbage until the trainer
    waits for its copies (0.3 s after save() handed the request over). The writer must write
    only after the trainer published them: every checkpoint must load back its own values."""
    with Checkpointer(CkptOptions(**options), stager=shm_stager(_LateShm, rank, options)) as ck:
        save_and_verify(ck, rank, world, root, range(1, saves + 1))
        assert all(r["phases"]["copy_wait_s"] >= 0.25 for r in ck.reports), ck.reports


def one_rank_changes_structure(rank: int, world: int, root: str, options: dict) -> None:
    """Constant-structure saves where at save 3 only rank 1 adds an entry (a whole tensor it
    alone holds). Re-planning and sharding validation are collectives, so every rank must
    re-plan and validate together: saves 1 and 3 validated, 2 and 4 not, on every rank; every
    checkpoint loads back its own values."""
    import megatron.core.dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor

    validated: list[bool] = []
    real_save = dc.save
    dc.save = lambda *a, **k: (validated.append(k.get("validate_access_integrity", True)),
                               real_save(*a, **k))[1]
    keys = ["a", "b"]
    expected = {}
    with Checkpointer(CkptOptions(**options)) as ck:
        for step in range(1, 5):
            if step == 3 and rank == 1:
                keys = keys + ["new"]
            live = trial_state(step, rank, keys)
            expected[step] = {k: v.clone() for k, v in live.items()}
            state = sharded(rank, world, {k: live[k] for k in ("a", "b")})
            if "new" in live:
                state["new"] = ShardedTensor.from_rank_offsets("new_on_rank1", live["new"])
            ck.save(state, root, iteration=step)
            ck.maybe_finalize(blocking=True)
        for step, want in expected.items():
            like = {k: torch.zeros_like(v) for k, v in want.items()}
            state = sharded(rank, world, {k: like[k] for k in ("a", "b")})
            if "new" in like:
                state["new"] = ShardedTensor.from_rank_offsets("new_on_rank1", like["new"])
            assert_equal(ck.load(state, root, iteration=step), want, f"iteration {step}")
    assert validated == [True, False, True, False], validated


class _Cyclic:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def gc_frozen_while_worker_forked(rank: int, world: int, root: str, options: dict, out: str) -> None:
    """Records, per rank: whether cyclic garbage made before the Checkpointer was collected by
    its construction, the gc freeze count while it is open (with a save done) and after close."""
    import gc
    import weakref

    base = gc.get_freeze_count()  # frozen by others (the GPU stack's imports freeze some)
    gc.disable()  # only an explicit collection may free the cycle below
    garbage = _Cyclic()
    dead = weakref.ref(garbage)
    del garbage
    try:
        ck = Checkpointer(CkptOptions(**options))
    finally:
        gc.enable()
    collected = dead() is None
    frozen_open = gc.get_freeze_count()
    live = step_state(1, rank)
    ck.save(sharded(rank, world, live), root, iteration=1)
    ck.maybe_finalize(blocking=True)
    assert_equal(load_back(ck, rank, world, root, 1), step_state(1, rank), "iteration 1")
    ck.close()
    Path(out, f"gc{rank}").write_text(f"{collected} {base} {frozen_open} {gc.get_freeze_count()}")


class _GatedCopies(_LateCopies):
    """Simulated device copies that land only once ``gate`` is set (then at every wait)."""

    def __init__(self, pairs: list, gate: Any, landed: list) -> None:
        super().__init__(pairs, 0.0)
        self.gate, self.landed = gate, landed

    def synchronize(self) -> None:
        assert self.gate.wait(60), "the gate never opened"
        for dst, src in self.pairs:
            dst.copy_(src)
        self.landed.append(True)


class _GatedShm(ShmStager):
    """Each save's copies land once that save's gate (the last of ``gates``) opens."""

    def __init__(self, gates: list, landed: list, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gates, self.landed = gates, landed

    def _copy(self, staged, tensors):  # type: ignore[no-untyped-def]
        pairs = _garbage_until_copied(staged, tensors)
        return [_GatedCopies(pairs, self.gates[-1], self.landed[-1])]


def overlap_roundtrip(rank: int, world: int, root: str, options: dict, saves: int) -> None:
    """--ckpt-overlap-snapshot: save() returns with the copies in flight; a torch optimizer's
    step waits for them (the Checkpointer's step pre-hook) before the state changes; the writer
    writes only once they are published. On CPU the device copies are simulated: they land only
    when a gate opens, after save() returned; on CUDA a 256 MiB tensor is overwritten right
    after the step. Then: a save not followed by any wait is warned about at the next save (and
    still correct); close() removes the hook."""
    import logging
    import threading

    cuda = device() == "cuda"
    # one gate and one record per save: a save's copies land once its own gate opens (a shared
    # gate closed again for the next save could hold back a late publisher of the previous one,
    # and that publisher's landing would count for the next save)
    gates, landed = [threading.Event()], [[]]
    stager = None if cuda else shm_stager(_GatedShm, rank, options, gates=gates, landed=landed)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("megatron_ckpt_ext").addHandler(handler)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, device=device()))], lr=0.1)
    waits: list[int] = []
    big = 64 << 20 if cuda else 0  # on CUDA, 256 MiB whose copy runs ~5 ms: a step that did not
    # wait for it would overwrite it (fill_(-7) below) while it is being copied

    def expected(step: int) -> dict[str, torch.Tensor]:
        out = step_state(step, rank)
        if big:
            out["big"] = torch.full((big,), float(step), device=device())
        return out

    def load(ck: Checkpointer, step: int) -> dict:
        like = {k: torch.zeros_like(v) for k, v in expected(0).items()}
        return ck.load(sharded(rank, world, like), root, iteration=step)

    live = expected(0)
    with Checkpointer(CkptOptions(**options), stager=stager) as ck:
        real_wait = ck.wait_for_snapshot
        ck.wait_for_snapshot = lambda **kw: (waits.append(1), real_wait(**kw))[1]
        for step in range(1, saves + 1):
            gates.append(threading.Event())
            landed.append([])
            for k, v in expected(step).items():
                live[k].copy_(v)
            ck.save(sharded(rank, world, live), root, iteration=step)
            assert cuda or not landed[-1], "save() waited for the copies"
            gates[-1].set()
            before = len(waits)
            opt.step()  # the training step that follows the save
            assert len(waits) == before + 1, "the optimizer step did not wait for the snapshot"
            assert cuda or landed[-1], "the optimizer step went on before the copies landed"
            for v in live.values():
                v.fill_(-7)  # the optimizer changes the state
            ck.maybe_finalize()
        # A save followed by no wait at all (and no change of the state): the next save warns,
        # waits, and both hold the values.
        for k, v in expected(saves + 1).items():
            live[k].copy_(v)
        for step in (saves + 1, saves + 2):
            ck.save(sharded(rank, world, live), root, iteration=step)
        ck.maybe_finalize(blocking=True)
        for step in range(1, saves + 3):
            assert_equal(load(ck, step), expected(min(step, saves + 1)), f"it {step}")
        assert all(r["mode"].endswith("-overlap") for r in ck.reports), [r["mode"] for r in ck.reports]
    logging.getLogger("megatron_ckpt_ext").removeHandler(handler)
    if rank == 0:
        assert any(f"save {saves + 2} started before anything waited" in m for m in messages), messages
    before = len(waits)
    opt.step()
    assert len(waits) == before, "close() left the optimizer hook installed"


class _SlowFirstWait(ShmStager):
    """The wait for its first save's copies takes ``delay_s`` longer (a copy that lands late)."""

    def __init__(self, delay_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delays = [delay_s]

    def _copy(self, staged, tensors):  # type: ignore[no-untyped-def]
        pending = super()._copy(staged, tensors)
        return pending + [_LateCopies([], self.delays.pop())] if self.delays else pending


def slowest_rank_report(rank: int, world: int, root: str, options: dict, delay_s: float) -> None:
    """The last rank holds more bytes (an extra tensor only it saves) and, at save 1 only, is
    ``delay_s`` slower waiting for its staged copies (the copy_wait phase, after the hand-over:
    the other ranks return from save() without waiting for it). Every rank's report of save 1
    must carry the slowest rank's figures (blocking, phase, durable; host bytes: the largest),
    the sum of the bytes, and its own bytes; save 2 (no delay) must not carry save 1's."""
    import json

    from megatron.core.dist_checkpointing import ShardedTensor

    slow = rank == world - 1
    stager = shm_stager(_SlowFirstWait, rank, options, delay_s=delay_s) if slow else None
    extra = torch.arange(5000, dtype=torch.float32, device=device()) + rank if slow else None
    nbytes = {r: sum(v.numel() * v.element_size() for v in step_state(0, r).values())
              + (5000 * 4 if r == world - 1 else 0) for r in range(world)}
    with Checkpointer(CkptOptions(**options), stager=stager) as ck:
        for step in (1, 2):
            state = sharded(rank, world, step_state(step, rank))
            if extra is not None:
                state["extra"] = ShardedTensor.from_rank_offsets("extra_on_last_rank", extra)
            ck.save(state, root, iteration=step)
            ck.maybe_finalize(blocking=True)
        first, second = ck.reports
    assert (first["bytes"], first["bytes_total"]) == (nbytes[rank], sum(nbytes.values())), first
    assert first["host_extra_bytes"] == max(nbytes.values()), first
    assert first["phases"]["copy_wait_s"] >= delay_s, first
    assert first["blocking_s"] >= delay_s and first["durable_s"] >= delay_s, first
    assert second["phases"]["copy_wait_s"] < delay_s and second["blocking_s"] < delay_s, second
    if rank == 0:
        lines = [json.loads(line) for line in (Path(root) / "ckpt_report.jsonl").read_text().splitlines()]
        assert [line["phases"] for line in lines] == [first["phases"], second["phases"]], lines


def shape_change_roundtrip(rank: int, world: int, root: str, options: dict) -> None:
    """--ckpt-assume-constant-structure with a tensor whose shape changes under the same key and
    at the same offsets (``w``: 64x8 per rank at saves 1-3, 64x12 at 4-5; a new storage, as a
    resized parameter gets). megatron-core reuses its cached plan without re-planning from the
    third save on, so ours must notice the change and rebuild it: every checkpoint loads back
    exactly its own values and shape (5 saved with the new plan kept)."""
    cols = {1: 8, 2: 8, 3: 8, 4: 12, 5: 12}

    def state(step: int) -> dict[str, torch.Tensor]:
        out = step_state(step, rank)
        g = torch.Generator().manual_seed(77 * step + rank)
        out["w"] = torch.randn(64, cols[step], generator=g).to(device())
        return out

    live = state(1)
    with Checkpointer(CkptOptions(**options)) as ck:
        for step in cols:
            if cols[step] != live["w"].shape[1]:
                live["w"] = torch.empty(64, cols[step], device=device())
            for k, v in state(step).items():
                live[k].copy_(v)
            ck.save(sharded(rank, world, live), root, iteration=step)
            for v in live.values():
                v.fill_(-7)
            ck.maybe_finalize(blocking=True)
        for step in cols:
            like = {k: torch.zeros_like(v) for k, v in state(step).items()}
            assert_equal(ck.load(sharded(rank, world, like), root, iteration=step), state(step),
                         f"iteration {step}")
