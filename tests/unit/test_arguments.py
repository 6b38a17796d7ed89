"""The argparse group: frozen flag set, defaults, help, host-parser idempotency."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import megatron_ckpt_ext as m
from megatron_ckpt_ext.arguments import flags
from megatron_ckpt_ext.errors import CkptOptionsError
from megatron_ckpt_ext.options import CkptOptions
from tests._support import load_script

# Adding a flag is a deliberate act: update this list in the same commit.
FROZEN_FLAGS = [
    "--async-save", "--async-ckpt-use-cpu-shm", "--dist-ckpt-workers",
    "--ckpt-assume-constant-structure", "--use-persistent-ckpt-worker", "--ckpt-overlap-snapshot",
    "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load", "--no-save-rng",
    "--no-load-rng", "--exit-on-missing-checkpoint", "--no-ckpt-verify-load", "--ckpt-load-threads",
    "--ckpt-load-fallback", "--no-ckpt-memory-restore", "--ckpt-restore-prefetch",
    "--ckpt-keep-memory-snapshot",
    "--ckpt-memory-snapshot-sets", "--ckpt-memory-partner",
    "--distributed-timeout-minutes", "--no-check-for-nan-in-loss-and-grad",
    "--logging-level", "--fsdp-use-symm-mem", "--async-ckpt-cpu-priority",
    "--async-ckpt-io-priority", "--ckpt-timeout",
    "--most-recent-k", "--save-retain-interval", "--ckpt-failure-policy",
    "--ckpt-node-memory-fallback", "--ckpt-node-memory-limit-mib",
    "--ckpt-max-consecutive-failures", "--exit-signal-handler",
    "--exit-signal",
    "--ckpt-preempt-grace-s",
]


def test_text_knobs_take_only_their_choices_from_every_source():
    import signal

    from megatron_ckpt_ext.errors import CkptOptionsError

    assert parse(["--ckpt-failure-policy", "warn"]).ckpt_failure_policy == "warn"
    with pytest.raises(SystemExit):
        parse(["--ckpt-failure-policy", "ignore"])
    with pytest.raises(CkptOptionsError, match="ckpt_failure_policy.*raise, warn"):
        CkptOptions.from_config({"ckpt_failure_policy": "ignore"})
    # Megatron-LM main declares --exit-signal as signal.Signals
    assert CkptOptions(exit_signal=signal.SIGUSR1).exit_signal == "SIGUSR1"
    with pytest.raises(CkptOptionsError, match="most_recent_k"):
        CkptOptions(most_recent_k=0)


@pytest.mark.parametrize("argv,want", [([], "auto"), (["--ckpt-restore-prefetch"], "on"),
                                       (["--ckpt-restore-prefetch", "off"], "off"),
                                       (["--ckpt-restore-prefetch", "auto"], "auto")])
def test_the_restore_prefetch_flag_alone_means_on_and_takes_a_mode(argv, want):
    """--ckpt-restore-prefetch was a switch: given alone it still turns the copy ahead on; it
    now also takes auto (the default) or off, and a config's true / false still mean on / off."""
    assert CkptOptions.from_args(parse(argv)).ckpt_restore_prefetch == want


@pytest.mark.parametrize("value,want", [(True, "on"), (False, "off"), ("auto", "auto")])
def test_the_restore_prefetch_key_takes_a_boolean_as_it_did(value, want):
    from megatron_ckpt_ext.errors import CkptOptionsError

    assert CkptOptions.from_config({"ckpt_restore_prefetch": value}).ckpt_restore_prefetch == want
    with pytest.raises(CkptOptionsError, match="ckpt_restore_prefetch.*auto, on, off"):
        CkptOptions.from_config({"ckpt_restore_prefetch": "yes"})


def test_the_restore_prefetch_key_in_yaml_reads_on_and_off_as_yaml_does(tmp_path):
    """YAML 1.1 reads a bare on / off as a boolean: they still mean on / off."""
    for text, want in (("on", "on"), ("off", "off"), ("auto", "auto")):
        (tmp_path / "c.yaml").write_text(f"ckpt_restore_prefetch: {text}\n")
        assert CkptOptions.from_yaml(tmp_path / "c.yaml").ckpt_restore_prefetch == want


def parse(argv, parser=None):
    return m.add_arguments(parser or argparse.ArgumentParser()).parse_args(argv)


def test_flag_set_is_frozen():
    assert flags() == FROZEN_FLAGS


def test_every_flag_parses_to_its_default():
    assert CkptOptions.from_args(parse([])) == CkptOptions()


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    missing = [f for f in FROZEN_FLAGS if f not in out]
    assert not missing


def test_flags_set_the_options():
    ns = parse(["--async-save", "--async-ckpt-use-cpu-shm", "--ckpt-assume-constant-structure",
                "--dist-ckpt-workers", "2", "--no-ckpt-fully-parallel-save",
                "--ckpt-fully-parallel-load", "--no-load-rng", "--no-save-rng",
                "--distributed-timeout-minutes", "30", "--no-check-for-nan-in-loss-and-grad",
                "--use-persistent-ckpt-worker", "--logging-level", "10"])
    o = CkptOptions.from_args(ns)
    assert (o.async_save, o.async_ckpt_use_cpu_shm, o.ckpt_assume_constant_structure,
            o.dist_ckpt_workers, o.ckpt_fully_parallel_save, o.ckpt_fully_parallel_load,
            o.load_rng, o.save_rng, o.distributed_timeout_minutes, o.check_for_nan_in_grad,
            o.use_persistent_ckpt_worker, o.logging_level) == (
        True, True, True, 2, False, True, False, False, 30, False, True, 10)


def test_megatron_dests_are_used():
    ns = parse(["--no-load-rng", "--no-check-for-nan-in-loss-and-grad"])
    assert ns.load_rng is False and ns.check_for_nan_in_loss_and_grad is False


@pytest.mark.parametrize("argv", [["--dist-ckpt-workers", "0"], ["--dist-ckpt-workers", "-2"],
                                  ["--dist-ckpt-workers", "two"],
                                  ["--distributed-timeout-minutes", "-5"],
                                  ["--ckpt-timeout", "0"]])
def test_invalid_value_exits_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert f"argument {argv[0]}: must be an integer >= 1" in capsys.readouterr().err


def test_registering_twice_is_harmless():
    p = m.add_arguments(m.add_arguments(argparse.ArgumentParser()))
    assert sum(a.option_strings == ["--async-save"] for a in p._actions) == 1
    assert [g.title for g in p._action_groups].count("checkpointing (megatron-ckpt-ext)") == 1


def _old_megatron_parser():
    """Flags as an older Megatron-LM (core_r0.13-like) defines them."""
    p = argparse.ArgumentParser(conflict_handler="error")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--async-save", action="store_true", default=None)
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true")
    g.add_argument("--no-load-rng", action="store_false", dest="load_rng")
    g.add_argument("--no-save-rng", action="store_false", dest="save_rng")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--logging-level", type=int, default=None)
    return p


def _new_megatron_parser():
    """A newer Megatron-LM (0.19-like): also has --dist-ckpt-workers and --async-ckpt-use-cpu-shm,
    and (hypothetically) a host dest that differs from ours."""
    p = _old_megatron_parser()
    p.add_argument("--dist-ckpt-workers", type=int, default=1)
    p.add_argument("--async-ckpt-use-cpu-shm", action="store_true", dest="ckpt_use_cpu_shm")
    return p


@pytest.mark.parametrize("host", [_old_megatron_parser, _new_megatron_parser])
def test_host_parser_flags_are_not_duplicated(host):
    p = m.add_arguments(m.add_arguments(host()))  # no argparse conflict error
    counts = {f: sum(f in a.option_strings for a in p._actions) for f in FROZEN_FLAGS}
    assert set(counts.values()) == {1}, counts


def test_host_dest_is_used_for_a_flag_the_host_already_has():
    p = m.add_arguments(_new_megatron_parser())
    ns = p.parse_args(["--async-save", "--async-ckpt-use-cpu-shm", "--dist-ckpt-workers", "3"])
    assert ns.ckpt_use_cpu_shm is True and not hasattr(ns, "async_ckpt_use_cpu_shm")
    opts = CkptOptions.from_args(ns)
    assert (opts.async_save, opts.async_ckpt_use_cpu_shm, opts.dist_ckpt_workers) == (True, True, 3)


@pytest.mark.parametrize("argv,save_rng,load_rng", [
    ([], True, True), (["--no-save-rng"], False, True), (["--no-load-rng"], True, False)])
def test_a_host_no_flag_that_stores_true_sets_our_knob_false(argv, save_rng, load_rng):
    """Megatron-LM 0.19 declares --no-save-rng / --no-load-rng with store_true, default None
    (dest no_save_rng): given, our save_rng / load_rng read False, not True."""
    p = argparse.ArgumentParser()
    p.add_argument("--no-save-rng", action="store_true", default=None)
    p.add_argument("--no-load-rng", action="store_true", default=None)
    opts = CkptOptions.from_args(m.add_arguments(p).parse_args(argv))
    assert (opts.save_rng, opts.load_rng) == (save_rng, load_rng)


def test_host_flag_without_our_range_check_is_still_validated():
    ns = m.add_arguments(_new_megatron_parser()).parse_args(["--dist-ckpt-workers", "0"])
    with pytest.raises(CkptOptionsError, match="--dist-ckpt-workers .* must be an integer >= 1, got 0"):
        CkptOptions.from_args(ns)


def test_usable_as_extra_args_provider_returns_parser():
    p = argparse.ArgumentParser()
    assert m.add_arguments(p) is p


def test_acceptance_command_prints_namespace():
    code = ("import argparse, megatron_ckpt_ext as m; p=m.add_arguments(argparse.ArgumentParser()); "
            "m.add_arguments(p); print(p.parse_args(['--async-save','--async-ckpt-use-cpu-shm',"
            "'--ckpt-assume-constant-structure','--dist-ckpt-workers','2']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("Namespace(") and "dist_ckpt_workers=2" in out and "async_save=True" in out


def test_absent_dest_keeps_default_and_host_none_means_unset():
    ns = argparse.Namespace(async_save=None, logging_level=None)  # a host without most of our flags
    opts = CkptOptions.from_args(ns)
    assert opts.async_save is False and opts.distributed_timeout_minutes == 10


# -- scripts/pretrain_gpt.py: its parser (no abbreviations) and the NaN check its flag governs ------
def _pretrain_gpt():
    return load_script("scripts/pretrain_gpt.py", "pretrain_gpt")


@pytest.mark.parametrize("abbrev", [["--async-sav"], ["--train-iter", "2"], ["--save-int", "1"],
                                    ["--ckpt-time", "5"], ["--no-check-for-nan"]])
def test_pretrain_gpt_rejects_abbreviated_flags(abbrev, capsys):
    with pytest.raises(SystemExit) as e:
        _pretrain_gpt().parse_args(["--train-iters", "2", *abbrev])
    assert e.value.code == 2 and f"unrecognized arguments: {abbrev[0]}" in capsys.readouterr().err


def test_pretrain_gpt_full_flags_still_parse():
    ns = _pretrain_gpt().parse_args(["--train-iters", "2", "--async-save", "--ckpt-timeout", "5",
                                     "--no-check-for-nan-in-loss-and-grad", "--exit-on-missing-checkpoint"])
    opts = CkptOptions.from_args(ns)
    assert (opts.async_save, opts.ckpt_timeout, opts.check_for_nan_in_grad,
            opts.exit_on_missing_checkpoint) == (True, 5, False, True)


def test_pretrain_gpt_ckpt_config_typo_stops_naming_file_and_key(tmp_path, capsys):
    cfg = tmp_path / "nemo.yaml"
    cfg.write_text("policy:\n  megatron_cfg:\n    tensor_model_parallel_size: 1\n    Async-Save: true\n")
    with pytest.raises(SystemExit) as e:
        _pretrain_gpt().main(["--train-iters", "1", "--ckpt-config", str(cfg)])
    assert e.value.code == 2  # a start-up error: one line on rank 0, no traceback
    assert capsys.readouterr().err.startswith(
        f"error: {cfg} (policy.megatron_cfg): unknown checkpoint config key 'Async-Save'; did you "
        "mean 'async_save'?")


def _model_with_grads(bad: float | None = None):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model(torch.ones(1, 3)).sum().backward()
    if bad is not None:
        model[1].weight.grad[0, 1] = bad
    return model


def test_nan_check_passes_finite_loss_and_gradients():
    import torch

    _pretrain_gpt().check_finite(torch.tensor(2.5), _model_with_grads(), iteration=7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_check_names_iteration_parameter_and_flag(bad):
    import torch

    with pytest.raises(FloatingPointError, match=r"iteration 7: the gradient of 1\.weight holds NaN/Inf.*"
                       r"--no-check-for-nan-in-loss-and-grad turns this check off"):
        _pretrain_gpt().check_finite(torch.tensor(2.5), _model_with_grads(bad), iteration=7)


def test_nan_check_names_a_non_finite_loss():
    import torch

    with pytest.raises(FloatingPointError, match=r"iteration 3: the loss is nan"):
        _pretrain_gpt().check_finite(torch.tensor(float("nan")), _model_with_grads(), iteration=3)
