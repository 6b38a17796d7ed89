"""Every checkpointing knob, defined once.

Each field of :class:`CkptOptions` carries a :class:`Knob` in its metadata: the CLI flag (Megatron's
spelling), the argparse ``dest`` (Megatron's), the help text, the config key (NeMo-RL
``megatron_cfg`` spelling) and, where the config path uses another default (NeMo-RL's), that
default. ``arguments.py`` derives the argparse group from these fields and
:meth:`CkptOptions.from_config` derives the config keys; no default is written twice.

Value checks (types and ranges) live here, in ``__post_init__``, because they hold for every source
(CLI, config, code). Rules that relate several knobs, or a knob and the installed backend, live in
``validation.py``. The diagnostic ``MCX_*`` environment switches are not options: they live in
``debug.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Mapping

from .errors import CkptOptionsError

__all__ = ["CkptOptions", "Knob", "knobs"]

_SAME = object()  # sentinel: the config default equals the CLI default


@dataclass(frozen=True)
class Knob:
    """How one option appears to users."""

    name: str = ""  # the CkptOptions field; filled in by knobs()
    flag: str = ""  # CLI flag, Megatron's spelling
    help: str = ""
    dest: str | None = None  # argparse dest where it differs from the field name (Megatron's)
    negative: bool = False  # the flag is a `--no-x` switch that stores False
    config_key: str | None = None  # defaults to the field name
    config_default: Any = _SAME
    minimum: int | None = None
    maximum: int | None = None
    optional: bool = False  # None is a valid value ("backend/torch default")
    choices: tuple[str, ...] | None = None  # a text knob's valid values
    excluded: tuple[int, ...] = ()  # integers in [minimum, maximum] that are not valid
    valid: str | None = None  # the valid values in words, where a range does not say it

    @property
    def arg_dest(self) -> str:
        return self.dest or self.name

    @property
    def key(self) -> str:
        return self.config_key or self.name

    def describe(self) -> str:
        """How to name this knob in an error: flag and config key."""
        return f"{self.flag} (config key '{self.key}')"


def _knob(default: Any, **kw: Any) -> Any:
    return field(default=default, metadata={"knob": Knob(**kw)})


@dataclass(frozen=True, kw_only=True)
class CkptOptions:
    """Checkpointing options. Build with :meth:`from_args`, :meth:`from_config` or keywords."""

    async_save: bool = _knob(
        False,
        flag="--async-save",
        help="Save checkpoints asynchronously: save() returns after staging and the write "
        "runs in the background; finalized by maybe_finalize().",
    )
    async_ckpt_use_cpu_shm: bool = _knob(
        False,
        flag="--async-ckpt-use-cpu-shm",
        help="Stage GPU tensors into per-tensor CPU shared memory in the training process "
        "before handing them to the writer (no CUDA IPC handles, no CUDA context in the "
        "writer). Use with --ckpt-assume-constant-structure so buffers are reused.",
    )
    dist_ckpt_workers: int = _knob(
        1,
        flag="--dist-ckpt-workers",
        minimum=1,
        help="Writer threads/processes per rank. 1 (default) writes sequentially in the process "
        "that owns the save, with no forked writers.",
    )
    ckpt_assume_constant_structure: bool = _knob(
        False,
        flag="--ckpt-assume-constant-structure",
        help="Cache the save plan, metadata and staging buffers across saves. The cache is "
        "validated on every save and rebuilt when the state's structure or storage changes.",
    )
    use_persistent_ckpt_worker: bool = _knob(
        False,
        flag="--use-persistent-ckpt-worker",
        help="Run async writes in one long-lived worker process started at start-up, instead of "
        "a fresh process per save.",
    )
    ckpt_overlap_snapshot: bool = _knob(
        False,
        flag="--ckpt-overlap-snapshot",
        help="With --async-save --async-ckpt-use-cpu-shm --use-persistent-ckpt-worker: save() "
        "returns once the device-to-host copies are queued; they run during the next "
        "iteration's forward and backward, and the next optimizer step waits for them (a "
        "torch.optim step pre-hook, device-side). The state must not change before that "
        "step; other optimizers call Checkpointer.wait_for_snapshot() first.",
    )
    ckpt_fully_parallel_save: bool = _knob(
        True,
        flag="--no-ckpt-fully-parallel-save",
        negative=True,
        config_key="fully_parallel_save",
        help="Disable fully parallel save (each data-parallel replica writes a distinct part).",
    )
    ckpt_fully_parallel_load: bool = _knob(
        False,
        flag="--ckpt-fully-parallel-load",
        config_key="fully_parallel_load",
        config_default=True,
        help="Load fully in parallel: each data-parallel rank reads a part and exchanges it.",
    )
    save_rng: bool = _knob(
        True,
        flag="--no-save-rng",
        negative=True,
        help="Do not save the RNG state with the checkpoint. Read by the training script, not "
        "by the Checkpointer (it saves the state dict it is given): Megatron-LM reads its own "
        "flag of this name; scripts/pretrain_gpt.py reads CkptOptions.save_rng and leaves the "
        "RNG state out of the state dict it saves.",
    )
    load_rng: bool = _knob(
        True,
        flag="--no-load-rng",
        negative=True,
        config_default=False,
        help="Do not restore the RNG state from the checkpoint (bit-exact resume needs it). "
        "Read by the training script, not by the Checkpointer (it loads the state dict it is "
        "given): Megatron-LM reads its own flag of this name; scripts/pretrain_gpt.py reads "
        "CkptOptions.load_rng and then neither asks for nor restores the RNG state.",
    )
    exit_on_missing_checkpoint: bool = _knob(
        False,
        flag="--exit-on-missing-checkpoint",
        help="With --load: fail when the directory holds no committed checkpoint (no tracker "
        "file) instead of warning and starting from scratch, as Megatron-LM does.",
    )
    ckpt_verify_load: bool = _knob(
        True,
        flag="--no-ckpt-verify-load",
        negative=True,
        help="Do not check a checkpoint's files against its integrity manifest (the CRC-32 of "
        "every file, written at save) before loading it. Checkpoints without a manifest load "
        "unverified either way.",
    )
    ckpt_load_threads: int = _knob(
        8,
        flag="--ckpt-load-threads",
        minimum=1,
        help="Threads per rank that read a checkpoint's bytes at load, each along its own stripe "
        "of the files, straight into the target tensors (through pinned chunks for GPU tensors). "
        "1: megatron-core's own one-at-a-time loop. A verified load sums the bytes on as many "
        "threads, at most the rank's share of the host's cores (the cores it may run on over "
        "LOCAL_WORLD_SIZE).",
    )
    ckpt_load_fallback: bool = _knob(
        False,
        flag="--ckpt-load-fallback",
        help="When the checkpoint the tracker names fails verification, load the newest older "
        "committed checkpoint that verifies (said on rank 0) instead of raising. A load of an "
        "explicit iteration still raises.",
    )
    ckpt_memory_restore: bool = _knob(
        True,
        flag="--no-ckpt-memory-restore",
        negative=True,
        help="With --async-ckpt-use-cpu-shm, do not keep the last committed save's staging "
        "buffers sealed in /dev/shm as a snapshot, nor restore a restarted job on this node from "
        "it: loads always read storage. By default a load uses the snapshot only when it is "
        "provably the checkpoint being loaded (save root, world size, iteration, commit, every "
        "tensor's layout and CRC-32), on every rank, else reads storage.",
    )
    ckpt_keep_memory_snapshot: bool = _knob(
        False,
        flag="--ckpt-keep-memory-snapshot",
        help="Keep the sealed snapshot in /dev/shm at a clean close (a planned restart on the "
        "same node restores from it); by default close() frees it. It is freed by the next "
        "seal, by age, or by 'python -m megatron_ckpt_ext shm clean'.",
    )
    distributed_timeout_minutes: int | None = _knob(
        10,
        flag="--distributed-timeout-minutes",
        minimum=1,
        optional=True,
        config_default=None,
        help="Timeout in minutes for torch.distributed collectives (and checkpoint waits). "
        "In a config, absent means torch's default.",
    )
    check_for_nan_in_grad: bool = _knob(
        True,
        flag="--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        negative=True,
        help="Do not check the loss and gradients for NaN/Inf every step. Read by the training "
        "script, not by the Checkpointer: Megatron-LM reads its own flag of this name; "
        "scripts/pretrain_gpt.py reads CkptOptions.check_for_nan_in_grad before each optimizer "
        "step.",
    )
    logging_level: int | None = _knob(
        None,
        flag="--logging-level",
        minimum=0,
        maximum=50,
        optional=True,
        help="Python logging level for megatron and this plugin (10=DEBUG, 20=INFO, ...).",
    )
    fsdp_use_symm_mem: bool = _knob(
        False,
        flag="--fsdp-use-symm-mem",
        help="Allocate Megatron-FSDP all-gather/reduce-scatter buffers from NCCL symmetric "
        "memory (needs CUDA and at least 2 GPUs).",
    )
    async_ckpt_cpu_priority: int | None = _knob(
        None,
        flag="--async-ckpt-cpu-priority",
        minimum=-20,
        maximum=19,
        optional=True,
        help="Nice value of the async checkpoint worker, where the backend supports it.",
    )
    async_ckpt_io_priority: int | None = _knob(
        None,
        flag="--async-ckpt-io-priority",
        minimum=0,
        maximum=7,
        optional=True,
        help="I/O priority (best-effort class, 0-7) of the async checkpoint worker, where the "
        "backend supports it.",
    )
    ckpt_timeout: int = _knob(
        1800,
        flag="--ckpt-timeout",
        minimum=1,
        help="Seconds an async save may take from save() to its commit before every rank raises "
        "(the writer is then stopped). A writer that dies is reported at the next "
        "maybe_finalize() whatever this is; this bounds a writer that is alive but stuck, so set "
        "it above your longest healthy write.",
    )

    # -- operations ----------------------------------------------------------------------------
    most_recent_k: int = _knob(
        -1,
        flag="--most-recent-k",
        minimum=-1,
        excluded=(0,),  # it would delete the newest checkpoint
        valid="-1 to keep every checkpoint, or K >= 1 to keep the K newest",
        help="Keep only the K most recent committed checkpoints under --save (-1: keep all; "
        "Megatron's CheckpointConfig name). Older ones are deleted in the background once the "
        "new checkpoint and its tracker are durable; never the tracker's target, a newer "
        "directory, a symlink or an unrelated directory.",
    )
    save_retain_interval: int | None = _knob(
        None,
        flag="--save-retain-interval",
        minimum=1,
        optional=True,
        help="Also keep every checkpoint whose iteration is a multiple of N when deleting old "
        "ones (Megatron-LM's flag). Given without --most-recent-k, keeps the latest plus those.",
    )
    ckpt_failure_policy: str = _knob(
        "raise",
        flag="--ckpt-failure-policy",
        choices=("raise", "warn"),
        help="What a failed async save does: 'raise' on every rank, or 'warn': the save is "
        "abandoned (the previous checkpoint stays the latest), rank 0 logs the reason and "
        "training goes on; the next save is tried. See --ckpt-max-consecutive-failures.",
    )
    ckpt_node_memory_fallback: str = _knob(
        "none",
        flag="--ckpt-node-memory-fallback",
        choices=("none", "sync"),
        help="When a node cannot hold what its ranks stage for an async save (node-level "
        "admission before the first staging): 'none' fails on every rank naming the node, the "
        "bytes and the fix; 'sync' saves synchronously instead (nothing is staged, each save "
        "blocks for its whole write; the reports' blocking_s shows what that costs), with one "
        "rank-0 WARNING.",
    )
    ckpt_max_consecutive_failures: int = _knob(
        3,
        flag="--ckpt-max-consecutive-failures",
        minimum=1,
        help="With --ckpt-failure-policy warn: this many failed saves in a row raise.",
    )
    exit_signal_handler: bool = _knob(
        False,
        flag="--exit-signal-handler",
        help="On --exit-signal (SIGTERM by default: SLURM, Kubernetes), take a checkpoint at the "
        "next iteration boundary, wait until it is durable and exit cleanly (Megatron-LM's "
        "flag). One rank seeing the signal is enough: the ranks agree at each boundary.",
    )
    exit_signal: str = _knob(
        "SIGTERM",
        flag="--exit-signal",
        choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT"),
        help="The signal --exit-signal-handler acts on.",
    )
    ckpt_preempt_grace_s: int | None = _knob(
        None,
        flag="--ckpt-preempt-grace-s",
        minimum=1,
        optional=True,
        help="Seconds the scheduler grants between its signal and the kill (SLURM's --signal "
        "lead, Kubernetes' terminationGracePeriodSeconds): rank 0 says, when the exit checkpoint "
        "starts, whether it is expected to be durable in time, and reports the time it took.",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.exit_signal, str) and hasattr(self.exit_signal, "name"):
            object.__setattr__(self, "exit_signal", self.exit_signal.name)  # Megatron's Signals
        for knob in knobs():
            _check_value(knob, getattr(self, knob.name))

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def from_args(cls, namespace: Any) -> CkptOptions:
        """From an argparse namespace (ours or a host Megatron's).

        An absent dest keeps the default, and so does ``None`` for a knob that has no "unset"
        meaning of its own: Megatron declares some switches (``--async-save``) with
        ``default=None`` to mean "not given".
        """
        dests: Mapping[str, str] = getattr(namespace, _DESTS_ATTR, None) or {}
        values = {}
        for knob in knobs():
            value = getattr(namespace, dests.get(knob.name, knob.arg_dest), _SAME)
            if value is not _SAME and (value is not None or knob.optional):
                values[knob.name] = value
        return cls(**values)

    @classmethod
    def from_config(cls, mapping: Mapping[str, Any], *, extra: str = "error") -> CkptOptions:
        """From a NeMo-RL style ``megatron_cfg`` mapping.

        A key that is absent keeps the config path's default, NeMo-RL's (fully_parallel_save
        True, fully_parallel_load True, load_rng False, async_save False, timeout = torch's
        default). ``extra="ignore"`` skips keys that are clearly the host's (a full megatron_cfg
        holds many model keys) but still rejects one that is a misspelling of ours (another case,
        dashes, Megatron-LM's name for it, or a near typo), naming the key to write; the default
        ``"error"`` rejects every key that is not ours, naming the closest valid one.
        """
        return _from_mapping(cls, mapping, extra=extra, source=None)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, extra: str = "error") -> CkptOptions:
        """From a YAML file: its top-level mapping, or its ``megatron_cfg`` (also under
        ``policy:``) section when present. Errors name the file and the section."""
        section, where = _config_section(load_yaml(path), path)
        return _from_mapping(cls, section, extra=extra, source=f"{path}{where}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def distributed_timeout(self) -> timedelta | None:
        """``--distributed-timeout-minutes`` as a timedelta (None: the backend's default), for
        ``init_process_group(timeout=...)`` and the plugin's own collectives."""
        minutes = self.distributed_timeout_minutes
        return None if minutes is None else timedelta(minutes=minutes)


_DESTS_ATTR = "_megatron_ckpt_ext_dests"


def knobs() -> Iterator[Knob]:
    """The knobs in declaration order, each with its field name filled in."""
    for f in dataclasses.fields(CkptOptions):
        yield dataclasses.replace(f.metadata["knob"], name=f.name)


def _check_value(knob: Knob, value: Any) -> None:
    default = _field_default(knob.name)
    if value is None and knob.optional:
        return
    if knob.choices is not None:
        if value not in knob.choices:
            raise CkptOptionsError(f"{knob.describe()} must be one of "
                                   f"{', '.join(knob.choices)}, got {value!r}")
        return
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise CkptOptionsError(
                f"{knob.describe()} must be true or false, got {value!r} "
                f"({type(value).__name__})"
            )
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise CkptOptionsError(
            f"{knob.describe()} must be an integer{_range_text(knob)}, got {value!r} "
            f"({type(value).__name__})"
        )
    if (knob.minimum is not None and value < knob.minimum) or (
        knob.maximum is not None and value > knob.maximum
    ) or value in knob.excluded:
        raise CkptOptionsError(f"{knob.describe()} must be an integer{_range_text(knob)}, got {value}")


def _field_default(name: str) -> Any:
    return CkptOptions.__dataclass_fields__[name].default


def _range_text(knob: Knob) -> str:
    if knob.valid is not None:
        return f" ({knob.valid})"
    if knob.minimum is not None and knob.maximum is not None:
        return f" in [{knob.minimum}, {knob.maximum}]"
    if knob.minimum is not None:
        return f" >= {knob.minimum}"
    return ""


_TYPO_CUTOFF = 0.85  # difflib ratio: no Megatron-LM argument or NeMo-RL megatron_cfg key reaches it
_LOOSE_CUTOFF = 0.5  # for the hint only, where every unknown key is an error anyway


def _from_mapping(cls: type[CkptOptions], mapping: Any, *, extra: str,
                  source: str | None) -> CkptOptions:
    if not isinstance(mapping, Mapping):
        raise CkptOptionsError(_where(source) + "checkpoint config must be a mapping of knob "
                               f"names to values, got {type(mapping).__name__}")
    if extra not in ("error", "ignore"):
        raise ValueError(f"extra must be 'error' or 'ignore', got {extra!r}")
    by_key = {k.key: k for k in knobs()}
    for key in mapping:
        if key not in by_key and (extra == "error" or _misspelt_key(key, by_key) is not None):
            raise CkptOptionsError(_unknown_key_message(key, by_key, extra=extra, source=source))
    values = {k.name: k.config_default for k in by_key.values() if k.config_default is not _SAME}
    for key, value in mapping.items():
        if key in by_key:
            values[by_key[key].name] = value
    try:
        return cls(**values)
    except CkptOptionsError as e:
        if source is None:
            raise
        raise CkptOptionsError(f"{_where(source)}{e}") from e


def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def _normalized(key: Any) -> str:
    return str(key).strip().lstrip("-").lower().replace("-", "_")


def _spellings(by_key: Mapping[str, Knob]) -> dict[str, Knob]:
    """Every spelling that means one of our knobs: its config key, field name, Megatron-LM
    argparse dest and flag (without ``--``, ``_`` for ``-``)."""
    spellings: dict[str, Knob] = {}
    for knob in by_key.values():
        for name in (knob.key, knob.name, knob.arg_dest, _normalized(knob.flag)):
            spellings.setdefault(name, knob)
    return spellings


def _misspelt_key(key: Any, by_key: Mapping[str, Knob]) -> Knob | None:
    """The knob that ``key`` (not one of our keys) is a misspelling of, or None when ``key`` is
    clearly someone else's."""
    spellings = _spellings(by_key)
    norm = _normalized(key)
    if norm in spellings:
        return spellings[norm]
    close = difflib.get_close_matches(norm, list(spellings), n=1, cutoff=_TYPO_CUTOFF)
    return spellings[close[0]] if close else None


def _unknown_key_message(key: Any, by_key: Mapping[str, Knob], *, extra: str = "error",
                         source: str | None = None) -> str:
    knob = _misspelt_key(key, by_key)
    if knob is None:
        close = difflib.get_close_matches(str(key), list(by_key), n=1, cutoff=_LOOSE_CUTOFF)
        knob = by_key[close[0]] if close else None
    hint = ""
    if knob is not None:
        hint = f"; did you mean '{knob.key}'?"
        if knob.negative and _normalized(key) == _normalized(knob.flag):
            hint += f" ({knob.flag} as a key has the opposite sense: write '{knob.key}: false')"
    msg = f"{_where(source)}unknown checkpoint config key '{key}'{hint}"
    if extra == "ignore":
        return (msg + " extra='ignore' skips keys that belong to the host, but this one is "
                "another spelling of a checkpoint knob: rename it, or it would be dropped "
                "silently.")
    return msg + f" Valid keys: {', '.join(sorted(by_key))}"


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file; errors name the file and, where the parser gives it, the line."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except FileNotFoundError as e:
        raise CkptOptionsError(f"config file not found: {path}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise CkptOptionsError(f"malformed YAML in {path}{where}: {problem}") from e


def _config_section(doc: Any, path: Any) -> tuple[Mapping[str, Any], str]:
    """The mapping that holds the knobs, and where it is (" (policy.megatron_cfg)" or "")."""
    if doc is None or (isinstance(doc, Mapping) and not doc):
        raise CkptOptionsError(f"{path}: the config file is empty. Fix: write the checkpoint "
                               "knobs in it (at the top level, or under policy.megatron_cfg or "
                               "megatron_cfg), or do not pass it.")
    if not isinstance(doc, Mapping):
        raise CkptOptionsError(f"{path}: expected a mapping at top level, got {type(doc).__name__}")
    policy = doc.get("policy")
    if isinstance(policy, Mapping) and "megatron_cfg" in policy:
        return policy["megatron_cfg"] or {}, " (policy.megatron_cfg)"
    if "megatron_cfg" in doc:
        return doc["megatron_cfg"] or {}, " (megatron_cfg)"
    by_key = {k.key: k for k in knobs()}
    if any(key in by_key or _misspelt_key(key, by_key) is not None for key in doc):
        return doc, ""
    raise CkptOptionsError(_no_section_message(doc, path, by_key))


def _sections(doc: Mapping[str, Any], prefix: str = "",
              depth: int = 3) -> Iterator[tuple[str, Any]]:
    """Every mapping-valued key of ``doc`` (dotted path, value), ``depth`` levels down."""
    for key, value in doc.items():
        if isinstance(value, Mapping) and depth > 0:
            yield f"{prefix}{key}", value
            yield from _sections(value, f"{prefix}{key}.", depth - 1)


def _no_section_message(doc: Mapping[str, Any], path: Any, by_key: Mapping[str, Knob]) -> str:
    """No knobs where they are read: name the section that most likely holds them (one with
    our keys, or named like megatron_cfg), and where it belongs."""
    def score(item: tuple[str, Any]) -> float:
        name, value = item
        ours = any(k in by_key for k in value)
        return ours + difflib.SequenceMatcher(None, name.rsplit(".", 1)[-1],
                                              "megatron_cfg").ratio()

    found = sorted(_sections(doc), key=score, reverse=True)
    hint = ""
    if found and score(found[0]) >= _LOOSE_CUTOFF + 0.1:
        name = found[0][0]
        want = "megatron_cfg" if "." not in name else "policy.megatron_cfg"
        hint = f" It has '{name}': did you mean '{want}'?"
    return (f"{path}: no checkpoint knobs found: they are read from 'policy.megatron_cfg', "
            "'megatron_cfg' or the top level of the file, and none of its top-level keys "
            f"({', '.join(map(str, list(doc)[:8]))}) is a knob.{hint} Fix: name the section "
            "'policy.megatron_cfg' (or 'megatron_cfg'); every knob elsewhere is dropped.")

