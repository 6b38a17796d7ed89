"""One error hierarchy: every error the package raises on purpose is a CkptError and keeps the
builtin base callers already catch; a shared-memory shortfall is not an options error and a
backend field mismatch is not an ImportError; errors.py and _runtime.py are leaves."""

from __future__ import annotations

import ast
import collections
import pickle
from pathlib import Path

import pytest

import megatron_ckpt_ext as mcx
from megatron_ckpt_ext import backend, errors, preflight
from tests._support.dist import FakeWork

PACKAGE = Path(mcx.__file__).parent

BUILTIN_BASE = {
    errors.CkptOptionsError: ValueError,
    errors.BackendUnavailable: ImportError,
    errors.BackendMismatch: RuntimeError,
    errors.InsufficientHostMemory: OSError,
    errors.InsufficientSharedMemory: OSError,
    errors.CheckpointWriteError: RuntimeError,
    errors.CheckpointIntegrityError: ValueError,
    errors.CheckpointLoadError: RuntimeError,
    errors.StagingFailed: RuntimeError,
    errors.MegatronAdapterError: RuntimeError,
    errors.CheckpointNotFound: FileNotFoundError,
    errors.SaveDirectoryInUse: RuntimeError,
    errors.SnapshotInUse: OSError,
}


def test_every_exported_error_is_listed_here():
    assert set(errors.__all__) == {c.__name__ for c in BUILTIN_BASE} | {"CkptError"}


@pytest.mark.parametrize("cls", BUILTIN_BASE, ids=lambda c: c.__name__)
def test_each_error_is_a_ckpt_error_and_keeps_its_builtin_base(cls):
    e = cls("the message names the fix")
    assert isinstance(e, errors.CkptError) and isinstance(e, BUILTIN_BASE[cls])
    assert str(e) == "the message names the fix"
    back = pickle.loads(pickle.dumps(e))  # writer-side errors cross process boundaries
    assert type(back) is cls and str(back) == str(e)


def test_error_kinds_do_not_overlap():
    """A shared-memory shortfall is no options error; a field mismatch is no ImportError."""
    assert not issubclass(errors.InsufficientSharedMemory, (errors.CkptOptionsError, ValueError))
    assert not issubclass(errors.BackendMismatch, (errors.BackendUnavailable, ImportError))


def test_public_api_exports_the_base_and_the_errors_a_loop_catches():
    for name in ("CkptError", "CkptOptionsError", "CheckpointWriteError"):
        assert name in mcx.__all__ and getattr(mcx, name) is getattr(errors, name)


def test_shm_shortfall_raises_insufficient_shared_memory_not_an_options_error():
    budget = tuple(preflight.HostBudget(2**20, 2**40, -1))  # 1 MiB of /dev/shm free
    with pytest.raises(errors.InsufficientSharedMemory) as e:
        preflight.admit_node(0, shm=True, gather=lambda mine: [("n", 2**21, budget, (0, 0))])
    assert isinstance(e.value, errors.InsufficientHostMemory)
    assert not isinstance(e.value, errors.CkptOptionsError)
    assert "--shm-size" in str(e.value) and "drop --async-ckpt-use-cpu-shm" in str(e.value)


def test_an_unwritable_save_directory_stays_an_options_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(errors.CkptOptionsError, match="--save"):
        preflight.check_writable(blocker / "ckpt")


def test_request_fields_unknown_to_the_backend_raise_backend_mismatch(monkeypatch):
    target = collections.namedtuple("AsyncRequest", ["async_fn", "async_fn_args"])
    newer = collections.namedtuple("AsyncRequest", ["async_fn", "async_fn_args", "new_field"])
    monkeypatch.setattr(backend.mcore, "async_request_cls", lambda: target)
    with pytest.raises(errors.BackendMismatch, match=r"fields \['new_field'\] unknown") as e:
        backend.adapt_async_request(newer(None, (), 1))
    assert not isinstance(e.value, ImportError)
    same = collections.namedtuple("AsyncRequest", ["async_fn", "async_fn_args"])
    assert backend.adapt_async_request(same(None, ())) == target(None, ())


@pytest.mark.parametrize("module", ["errors.py", "_runtime.py"])
def test_ground_modules_import_nothing_from_the_package(module):
    tree = ast.parse((PACKAGE / module).read_text())
    relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    absolute = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                if a.name.startswith("megatron_ckpt_ext")]
    assert relative == [] and absolute == []


# -- deliberate raises: the hierarchy, or a builtin errors.py documents ------------------------------
# (module, the raised type as written) -> the rule of errors.py's docstring it follows
DOCUMENTED_BUILTINS = {
    ("__init__.py", "AttributeError"): "protocol: module __getattr__",
    ("arguments.py", "argparse.ArgumentTypeError"): "protocol: argparse's type= callables",
    ("__main__.py", "argparse.ArgumentTypeError"): "protocol: argparse's type= callables",
    ("launch.py", "SystemExit"): "protocol: a command line's exit status",
    ("spool.py", "queue.Empty"): "protocol: the queue the writers read",
    ("_threads.py", "ValueError"): "bad argument",
    ("_crc_device.py", "ValueError"): "bad argument (a piece SlotSums does not take)",
    ("options.py", "ValueError"): "bad argument (extra= of from_config)",
    ("fsdp.py", "ValueError"): "bad argument (a model or optimizer it cannot shard)",
    ("fsdp.py", "KeyError"): "bad argument (a loaded mapping that lacks an entry)",
    ("save/layout.py", "ValueError"): "bad argument (a plain tensor in the state dict, an "
                                      "iteration that is no non-negative integer)",
    ("load/locate.py", "ValueError"): "bad argument (a plain tensor among a load's targets)",
    ("staging/shm.py", "ValueError"): "bad argument (keys) / internal (a seal's sizes, dtype)",
    ("fsdp.py", "RuntimeError"): "wrong state (no process group)",
    ("checkpointer.py", "RuntimeError"): "wrong state (a closed Checkpointer)",
    ("staging/shm.py", "RuntimeError"): "wrong state (a closed stager)",
    ("backend/direct_read.py", "OSError"): "the OS: a file cut short under a read",
    ("save/layout.py", "OSError"): "the OS: a tracker that cannot be read, with the fix",
    ("staging/segments.py", "OSError"): "the OS: the open-files limit",
    ("backend/load_reader.py", "AssertionError"): "the backend's own: torch DCP's reader check",
    ("backend/direct_read.py", "pickle.UnpicklingError"): "internal: the item goes stock",
    ("backend/direct_read.py", "zipfile.BadZipFile"): "internal: the item goes stock",
    ("save/joblock.py", "OSError"): "internal: caught by _acquire",
    ("save/joblock.py", "_InUse"): "internal: caught by _acquire",
    ("staging/ready.py", "TimeoutError"): "internal: the writer's, reported as a "
                                          "CheckpointWriteError at the finalize",
    ("launch.py", "LaunchError"): "internal: main() prints it and exits",
    ("staging/partner.py", "PartnerError"): "internal: a partner copy or fetch that failed; "
                                            "caught there, said in the counters or the load's "
                                            "memory_detail (the load reads storage)",
    ("staging/partner_wire.py", "PartnerError"): "internal: as staging/partner.py's",
    ("backend/replay.py", "ValueError"): "internal: a writer it cannot replay; caught there, "
                                         "the save is planned in full",
    ("load/managed_block.py", "RuntimeError"): "internal: a CUDA runtime call that failed; "
                                               "caught there: no block, the load copies from "
                                               "host memory",
    ("load/managed_block.py", "OSError"): "internal: no CUDA runtime library; caught there, "
                                          "as its RuntimeError",
}


def _raised_types() -> set[tuple[str, str]]:
    """(module, type as written) of every ``raise X`` / ``raise X(...)`` in the package whose
    X is a class outside the hierarchy; re-raised variables and factories are skipped."""
    import builtins
    import importlib

    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        name = ".".join(["megatron_ckpt_ext", *rel[:-3].split("/")]).removesuffix(".__init__")
        namespace = vars(importlib.import_module(name))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if not isinstance(target, (ast.Name, ast.Attribute)):
                continue
            text = ast.unparse(target)
            root, *attrs = text.split(".")
            obj = namespace.get(root, getattr(builtins, root, None))
            for attr in attrs:
                obj = getattr(obj, attr, None)
            if isinstance(obj, type) and not issubclass(obj, errors.CkptError):
                found.add((rel, text))
    return found


def test_every_deliberate_raise_uses_the_hierarchy_or_a_documented_builtin():
    found = _raised_types()
    new = sorted(found - set(DOCUMENTED_BUILTINS))
    assert not new, (f"{new}: raise a class of megatron_ckpt_ext/errors.py, or, where its "
                     "docstring's rule for builtins applies, add the pair here with that rule")
    assert found >= {("fsdp.py", "ValueError"), ("__init__.py", "AttributeError")}  # the scan


def test_a_damaged_manifest_is_an_integrity_error_and_still_a_value_error():
    from megatron_ckpt_ext.manifest import ManifestError

    e = ManifestError("mcx_manifest.json is not readable JSON")
    assert isinstance(e, errors.CheckpointIntegrityError) and isinstance(e, ValueError)


def test_a_knob_nothing_in_the_package_reads_says_who_reads_it():
    """Invariant: no option that nothing reads. --no-save-rng and the like are the trainer's."""
    from megatron_ckpt_ext.options import knobs

    names = {k.name for k in knobs()}
    read = {n.attr for path in PACKAGE.rglob("*.py")
            if path.name not in ("options.py", "arguments.py")
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr in names}
    unread = {k.name: k.help for k in knobs() if k.name not in read}
    assert set(unread) == {"save_rng", "load_rng", "check_for_nan_in_grad"}
    for name, text in unread.items():
        assert "not by the Checkpointer" in text and "Megatron-LM" in text, name
        assert "scripts/pretrain_gpt.py reads CkptOptions." + name in text, name


# -- the plugin's collectives: bounded, and the error names the journey ------------------------------
@pytest.fixture
def two_fake_ranks(monkeypatch):
    """A Group that believes it has two ranks; torch's collectives replaced by ``calls``."""
    import torch

    from megatron_ckpt_ext.collectives import Group

    calls: dict = {"works": [], "fail": False}

    def collective(out, tensor=None, group=None, async_op=False, op=None):
        assert async_op, "every collective of ours is waited for with a bound"
        if tensor is not None:  # all_gather: both ranks send what this one sends
            for o in out:
                o.copy_(tensor)
        work = FakeWork(fail=calls["fail"])
        calls["works"].append(work)
        return work

    monkeypatch.setattr(Group, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(Group, "size", lambda self: 2)
    monkeypatch.setattr(Group, "_device", lambda self: torch.device("cpu"))
    monkeypatch.setattr(Group, "control", lambda self: None)  # the default group, faked below
    monkeypatch.setattr(torch.distributed, "all_gather", collective)
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, op=None, group=None, async_op=False: collective(t, None, group,
                                                                                  async_op))
    return calls


def test_all_gather_is_bounded_by_distributed_timeout_minutes(two_fake_ranks):
    from datetime import timedelta

    from megatron_ckpt_ext.collectives import Group

    from megatron_ckpt_ext.collectives import _SLICE_S

    group = Group(None, mcx.CkptOptions(distributed_timeout_minutes=3))
    assert group.all_gather(("host", "why", {"n": 1})) == [("host", "why", {"n": 1})] * 2
    # waited in slices, the bound read on the clock that leaves a stopped job's time out
    # (test_suspend.py: a stop inside one of them)
    assert [w.timeouts for w in two_fake_ranks["works"]] == [[timedelta(seconds=_SLICE_S)]] * 2
    two_fake_ranks["fail"] = True
    with pytest.raises(errors.CheckpointWriteError, match="--distributed-timeout-minutes 3"):
        group.all_gather("x")


def test_all_gather_round_trips_objects_through_a_real_group(one_rank_group):
    from megatron_ckpt_ext.collectives import Group

    group = Group(None, mcx.CkptOptions())
    assert group.all_gather({"rank": 0, "why": "é" * 300}) == [{"rank": 0, "why": "é" * 300}]


def test_a_timed_out_load_collective_raises_a_load_error_that_speaks_of_load(two_fake_ranks):
    from pathlib import Path

    from megatron_ckpt_ext.collectives import Group
    from megatron_ckpt_ext.load.report import LoadRecord

    two_fake_ranks["fail"] = True
    group = Group(None, mcx.CkptOptions(distributed_timeout_minutes=3))
    with pytest.raises(errors.CheckpointLoadError) as e:
        LoadRecord(root=Path("ckpt")).entry(group)  # the load's report: a collective
    assert not isinstance(e.value, errors.CheckpointWriteError)
    text = str(e.value)
    assert "--distributed-timeout-minutes 3" in text and "load()" in text
    assert "save()" not in text and "maybe_finalize" not in text


def test_a_timed_out_save_collective_still_raises_a_write_error(two_fake_ranks):
    import time
    from pathlib import Path

    from megatron_ckpt_ext.collectives import Group
    from megatron_ckpt_ext.save.report import SaveRecord, gather

    two_fake_ranks["fail"] = True
    group = Group(None, mcx.CkptOptions(distributed_timeout_minutes=3))
    record = SaveRecord(iteration=1, root=Path("ckpt"), started=time.perf_counter())
    with pytest.raises(errors.CheckpointWriteError, match="save\\(\\) and maybe_finalize") as e:
        gather(record, group)  # the commit's first barrier
    assert not isinstance(e.value, errors.CheckpointLoadError)


def test_a_closed_checkpointer_names_the_fix(tmp_path):
    """RuntimeError is the documented builtin for a call in the wrong state; it says what to do."""
    ckpt = mcx.Checkpointer(mcx.CkptOptions())
    ckpt.close()
    with pytest.raises(RuntimeError, match="build a new Checkpointer"):
        ckpt.save({}, tmp_path, iteration=1)
