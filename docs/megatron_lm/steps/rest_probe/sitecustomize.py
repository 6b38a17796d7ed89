"""A probe, not part of the package: with MCX_REST_PROBE=<file> on PYTHONPATH (profile_restart.sh
REST_PROBE=1), times megatron-core's steps inside a restore from memory's load of the rest
(load/memory.py: _load_rest_and_fill) and appends one JSON line per restore to <file>.
Python 3.12's cProfile follows every thread, so its profile of a restart mixes in the background
threads' work; these wall-clock timers are taken on the loading thread only."""

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("MCX_REST_PROBE")
_TARGETS = [
    ("megatron.core.dist_checkpointing.serialization", "verify_checkpoint_and_load_strategy"),
    ("megatron.core.dist_checkpointing.serialization", "load_preprocess"),
    ("megatron.core.dist_checkpointing.serialization", "validate_integrity_and_strict_load"),
    ("megatron.core.dist_checkpointing.serialization", "apply_factory_merges"),
    ("megatron.core.dist_checkpointing.serialization", "load_common"),
    ("megatron.core.dist_checkpointing.validation", "determine_global_metadata"),
    ("megatron.core.dist_checkpointing.validation", "validate_sharding_integrity"),
    ("megatron.core.dist_checkpointing.strategies.torch", "TorchDistLoadShardedStrategy.load"),
    ("megatron.core.dist_checkpointing.strategies.torch", "TorchDistLoadShardedStrategy.load_common"),
    ("megatron.core.dist_checkpointing.strategies.common", "TorchCommonLoadStrategy.load_common"),
    ("megatron.core.dist_checkpointing.strategies.common", "TorchCommonLoadStrategy.load_sharded_objects"),
    ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_data"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_metadata"),
    ("torch", "load"),
]
_record = threading.local()


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        steps = getattr(_record, "steps", None)
        if steps is None:
            return fn(*args, **kwargs)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            steps.append((name, round(time.perf_counter() - t, 6)))
    wrapper.__wrapped__ = fn
    return wrapper


def _install():
    import importlib as il
    for mod, attr in _TARGETS:
        try:
            m = il.import_module(mod)
        except Exception:  # noqa: BLE001
            continue
        owner, name = m, attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(m, cls, None)
        if owner is not None and callable(getattr(owner, name, None)):
            setattr(owner, name, _timed(attr, getattr(owner, name)))


def _patch(memory):
    original = memory._load_rest_and_fill

    def probed(*args, **kwargs):
        _install()
        _record.steps = []
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            total = round(time.perf_counter() - t, 6)
            steps, _record.steps = _record.steps, None
            with open(_OUT, "a") as fh:
                fh.write(json.dumps({"rest_s": total, "steps": steps}) + "\n")

    memory._load_rest_and_fill = probed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron_ckpt_ext.load.memory":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)
        loader.exec_module = exec_module
        return spec


if _OUT:
    sys.meta_path.insert(0, _Finder())
