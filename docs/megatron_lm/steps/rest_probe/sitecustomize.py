"""A probe, not part of the package: with MCX_REST_PROBE=<file> on PYTHONPATH (profile_restart.sh
REST_PROBE=1), times megatron-core's steps inside a restore from memory's load of the rest
(load/memory.py: _load_rest_and_fill) and appends one JSON line per restore to <file>; and
times the steps of Megatron-LM's whole load_checkpoint (what its load-checkpoint timer holds:
the first look at the common state, the state dict built for the load, our load, the model's
and the optimizer's load_state_dict, the RNG, the barrier) on the calling thread, one JSON line
per load_checkpoint ({"megatron_load_checkpoint_s": ..., "steps": [[name, depth, s], ...]}).
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


def _owners(targets):
    """(owner, attribute name, "module attribute" label) of each importable target."""
    import importlib as il
    for mod, attr in targets:
        try:
            m = il.import_module(mod)
        except Exception:  # noqa: BLE001
            continue
        owner, name = m, attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(m, cls, None)
        if owner is not None:
            yield owner, name, attr


def _install():
    for owner, name, attr in _owners(_TARGETS):
        if callable(getattr(owner, name, None)):
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
    """Runs ``patch(module)`` once the module named ``target`` has been executed."""

    def __init__(self, target, patch):
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        run, patch = loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)
        loader.exec_module = exec_module
        return spec


# Megatron-LM's load_checkpoint: (module, attribute) pairs timed while it runs, nested with depth
_MLM_TARGETS = [
    ("megatron.training.checkpointing", "_load_base_checkpoint"),
    ("megatron.training.checkpointing", "generate_state_dict"),
    ("megatron.training.checkpointing", "_build_sharded_state_dict_metadata"),
    ("megatron.training.checkpointing", "checkpoint_exists"),
    ("megatron.training.checkpointing", "read_metadata"),
    ("megatron.training.checkpointing", "print_rank_0"),
    ("megatron.training.checkpointing", "get_rerun_state_machine"),
    ("megatron.core.dist_checkpointing", "load_content_metadata"),
    ("megatron.core.dist_checkpointing", "load_common_state_dict"),
    ("megatron.core.dist_checkpointing", "load"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.load_state_dict"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.load_state_dict"),
    ("megatron.core.optimizer.optimizer", "ChainedOptimizer.load_state_dict"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer._restore_common_per_param_step"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer._filter_and_reorder_param_groups"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.sharded_state_dict"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.sharded_state_dict"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.sharded_state_dict"),
    ("megatron.core.optimizer.optimizer", "ChainedOptimizer.sharded_state_dict"),
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.load_state_dict"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.sharded_state_dict"),
    ("torch.optim.optimizer", "Optimizer.load_state_dict"),
    ("torch.nn.modules.module", "Module.load_state_dict"),
    ("torch.cuda", "set_rng_state"),
    ("torch.distributed", "barrier"),
    ("copy", "deepcopy"),
]
_mlm = threading.local()
_STACK: list = []  # the loading thread's open steps, read by the sampler
_SAMPLE_S = 0.002


def _sampler(stop, counts, main_ident):
    """Every _SAMPLE_S while a load_checkpoint runs: what each other thread is in (its innermost
    frame), keyed by the loading thread's innermost open step: which background work overlaps
    which of Megatron's steps."""
    import os.path
    while not stop.wait(_SAMPLE_S):
        step = _STACK[-1] if _STACK else "(none)"
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident in (main_ident, threading.get_ident()):
                continue
            code = frame.f_code
            key = f"{step} | {names.get(ident, ident)} | {code.co_name} " \
                  f"({os.path.basename(code.co_filename)}:{frame.f_lineno})"
            counts[key] = counts.get(key, 0) + 1


def _gc_totals(gcs):
    """[step, generation, collections, seconds] per step and generation."""
    out = {}
    for step, generation, seconds in gcs:
        n, total = out.get((step, generation), (0, 0.0))
        out[(step, generation)] = (n + 1, total + seconds)
    return [[k[0], k[1], n, round(total, 6)] for k, (n, total) in out.items()]


def _gc_callback(gcs):
    def callback(phase, info):
        if getattr(_mlm, "steps", None) is None:
            return
        if phase == "start":
            _mlm.gc_t = time.perf_counter()
        elif getattr(_mlm, "gc_t", None) is not None:
            step = _STACK[-1] if _STACK else "(none)"
            gcs.append((step, info.get("generation"), round(time.perf_counter() - _mlm.gc_t, 6)))
            _mlm.gc_t = None
    return callback


def _mlm_timed(name, fn):
    import functools

    @functools.wraps(fn)  # inspect.signature sees fn's: the launcher feature-detects with it
    def wrapper(*args, **kwargs):
        steps = getattr(_mlm, "steps", None)
        if steps is None or getattr(_mlm, "in_deepcopy", False):
            return fn(*args, **kwargs)
        depth = _mlm.depth
        _mlm.depth += 1
        deep = name == "deepcopy"
        if deep:  # deepcopy recurses: count the outermost call only
            _mlm.in_deepcopy = True
        _STACK.append(name)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _STACK.pop()
            _mlm.depth -= 1
            if deep:
                _mlm.in_deepcopy = False
            steps.append((name, depth, round(time.perf_counter() - t, 6)))
    wrapper._mlm_probe = True
    return wrapper


def _mlm_install():
    for owner, name, attr in _owners(_MLM_TARGETS):
        raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if raw is None or getattr(getattr(raw, "__func__", raw), "_mlm_probe", False):
            continue
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(_mlm_timed(attr, raw.__func__)))
        elif callable(raw):
            setattr(owner, name, _mlm_timed(attr, raw))


def _mlm_patch(training):
    import megatron.training.checkpointing as ckpt
    original = ckpt.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        import gc
        _mlm_install()
        _mlm.steps, _mlm.depth, _mlm.in_deepcopy = [], 0, False
        counts, gcs, stop = {}, [], threading.Event()
        callback = _gc_callback(gcs)
        gc.callbacks.append(callback)
        sampler = threading.Thread(target=_sampler, args=(stop, counts, threading.get_ident()),
                                   name="probe-sampler", daemon=True)
        sampler.start()
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            total = round(time.perf_counter() - t, 6)
            stop.set()
            sampler.join()
            gc.callbacks.remove(callback)
            steps, _mlm.steps = _mlm.steps, None
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:40]
            with open(_OUT, "a") as fh:
                fh.write(json.dumps({"megatron_load_checkpoint_s": total,
                                     "steps": [s for s in steps if s[2] >= 0.0002 or s[1] == 0],
                                     "gc": _gc_totals(gcs), "sample_s": _SAMPLE_S,
                                     "other_threads": top}) + "\n")

    ckpt.load_checkpoint = load_checkpoint
    if getattr(training, "load_checkpoint", None) is original:
        training.load_checkpoint = load_checkpoint


if _OUT:
    sys.meta_path.insert(0, _Finder("megatron_ckpt_ext.load.memory", _patch))
    sys.meta_path.insert(0, _Finder("megatron.training.training", _mlm_patch))
