"""The knob table: one dataclass field per checkpointing knob, each carrying a :class:`Knob`
(CLI flag, argparse dest, help, config key and config default). :class:`~.options.CkptOptions`
inherits these fields in this order and adds the value checks and the constructors; nothing else
should import this module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._threads import AUTO

__all__ = ["Knob"]

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
    auto: bool = False  # an integer knob that also takes "auto": a count derived at run time
    # a text knob whose flag may be given without a value (then this one); its config value may
    # also be a boolean (true: this value, false: "off"), as when it was a switch
    bare: str | None = None

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
class _KnobTable:
    """The fields of :class:`~.options.CkptOptions`, in the order of ``--help`` and to_dict()."""

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
        help="Cache the save plan, metadata and staging buffers across saves; a steady save "
        "replays the request megatron-core planned for the same structure. The cache is "
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
    ckpt_load_threads: int | str = _knob(
        AUTO,
        flag="--ckpt-load-threads",
        minimum=1,
        auto=True,
        help="Threads per rank that read a checkpoint's bytes at load, each along its own stripe "
        "of the files, straight into the target tensors (through pinned chunks for GPU tensors). "
        "'auto': 8, at most the rank's share of the host's cores (the cores it may run on over "
        "LOCAL_WORLD_SIZE) and at least 2, so 8 ranks on 16 cores read on 2 threads each; an "
        "integer N: N "
        "threads whatever the cores. 1: megatron-core's own one-at-a-time loop. A verified load "
        "sums the bytes on as many threads, at most the rank's share of the cores.",
    )
    ckpt_load_fallback: bool = _knob(
        False,
        flag="--ckpt-load-fallback",
        help="When the checkpoint the tracker names fails verification or is missing, load the "
        "newest older committed checkpoint that verifies (said on rank 0) instead of raising. "
        "A load of an explicit iteration still raises.",
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
    ckpt_restore_prefetch: str = _knob(
        "auto",
        flag="--ckpt-restore-prefetch",
        choices=("auto", "on", "off"),
        bare="on",
        help="In a restore from memory prepared ahead of the load, also copy the snapshot to "
        "the device, summing it on the way: the load then copies device to device. The block "
        "is torch's own (kept in its cache for training after the load) where the device's "
        "free memory holds it beside all the memory the saving run's process ever held (its "
        "seal records it), else, with 'on', CUDA managed memory where the free memory is at "
        "least 4 times the snapshot (a model that needs the room evicts it to host memory; "
        "freed after the load), else none. 'auto' (the default): only in the launcher's early "
        "preparation (in Megatron's initialisation, seconds before the model build) and only "
        "into torch's own block; 'on' (the flag given alone): wherever a restore is "
        "prepared; 'off': never (docs/MEMORY.md).",
    )
    ckpt_keep_memory_snapshot: bool = _knob(
        False,
        flag="--ckpt-keep-memory-snapshot",
        help="Keep the sealed snapshot in /dev/shm at a clean close (a planned restart on the "
        "same node restores from it); by default close() frees it. It is freed by the next "
        "seal, by age, or by 'python -m megatron_ckpt_ext shm clean'.",
    )
    ckpt_memory_snapshot_sets: int = _knob(
        1,
        flag="--ckpt-memory-snapshot-sets",
        minimum=1,
        maximum=2,
        help="Staging buffer sets per rank kept for the memory tier (--async-ckpt-use-cpu-shm). "
        "1: the next save stages into the sealed snapshot's buffers, so a job killed while a "
        "save stages, writes or commits restarts from storage. 2: the next save stages into a "
        "second set and the last committed snapshot stays sealed until the next commit, so a "
        "restart on the node restores from memory whenever it dies; costs twice the staging "
        "host memory (node admission counts both).",
    )
    ckpt_memory_partner: bool = _knob(
        False,
        flag="--ckpt-memory-partner",
        help="With the memory tier (--async-ckpt-use-cpu-shm), also copy each rank's sealed "
        "snapshot, in the background after it is sealed, over TCP into the /dev/shm of a rank "
        "on the next node (the one at the same local index), so that a job restarted after "
        "losing one node still restores from memory: the lost node's ranks fetch their "
        "snapshots back from those copies before the load, every byte checked against the "
        "seal. Costs one more snapshot per rank in the node's shared memory (node admission "
        "counts it) and one network copy per save. With every rank on one node nothing is "
        "copied.",
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
        "it above your longest healthy write. Time the job stood suspended (stopped whole) does "
        "not count.",
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
    ckpt_node_memory_limit_mib: int | None = _knob(
        None,
        flag="--ckpt-node-memory-limit-mib",
        minimum=1,
        optional=True,
        help="Node-level admission (read by the Checkpointer before the first async save's "
        "staging) takes at most this many MiB of each node's MemAvailable and /dev/shm for "
        "what its ranks stage, reserving the rest (data loaders, other jobs); a node whose "
        "ranks stage more fails (or, with --ckpt-node-memory-fallback sync, saves "
        "synchronously). Unset: the measured figures.",
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
