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

PACKAGE = Path(mcx.__file__).parent

BUILTIN_BASE = {
    errors.CkptOptionsError: ValueError,
    errors.BackendUnavailable: ImportError,
    errors.BackendMismatch: RuntimeError,
    errors.InsufficientHostMemory: OSError,
    errors.InsufficientSharedMemory: OSError,
    errors.CheckpointWriteError: RuntimeError,
    errors.CheckpointIntegrityError: ValueError,
    errors.StagingFailed: RuntimeError,
    errors.MegatronAdapterError: RuntimeError,
    errors.CheckpointNotFound: FileNotFoundError,
    errors.SaveDirectoryInUse: RuntimeError,
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
        preflight.admit_node(0, shm=True, gather=lambda mine: [("n", 2**21, budget)])
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
