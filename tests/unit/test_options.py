"""CkptOptions: defaults, value checks, config knobs and YAML loading."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ckpt_ext.errors import CkptOptionsError
from megatron_ckpt_ext.options import CkptOptions, knobs

CLI_DEFAULTS = dict(
    async_save=False, async_ckpt_use_cpu_shm=False, dist_ckpt_workers=1,
    ckpt_assume_constant_structure=False, use_persistent_ckpt_worker=False, ckpt_overlap_snapshot=False,
    ckpt_fully_parallel_save=True, ckpt_fully_parallel_load=False, save_rng=True, load_rng=True,
    exit_on_missing_checkpoint=False, ckpt_verify_load=True, ckpt_load_threads="auto",
    ckpt_load_fallback=False, ckpt_memory_restore=True, ckpt_restore_prefetch="auto",
    ckpt_keep_memory_snapshot=False,
    ckpt_memory_snapshot_sets=1, ckpt_memory_partner=False,
    distributed_timeout_minutes=10, check_for_nan_in_grad=True, logging_level=None,
    fsdp_use_symm_mem=False, async_ckpt_cpu_priority=None, async_ckpt_io_priority=None,
    ckpt_timeout=1800, most_recent_k=-1, save_retain_interval=None, ckpt_failure_policy="raise",
    ckpt_node_memory_fallback="none", ckpt_node_memory_limit_mib=None,
    ckpt_max_consecutive_failures=3, exit_signal_handler=False,
    exit_signal="SIGTERM", ckpt_preempt_grace_s=None,
)
# The config path's historical defaults (NeMo-RL megatron_cfg): these four differ from the CLI.
CONFIG_DEFAULTS = {**CLI_DEFAULTS, "ckpt_fully_parallel_load": True, "load_rng": False,
                   "distributed_timeout_minutes": None}


def test_keyword_defaults_are_megatron_cli_defaults():
    assert dataclasses.asdict(CkptOptions()) == CLI_DEFAULTS


def test_options_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        CkptOptions(True)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CkptOptions().async_save = True  # type: ignore[misc]


def test_every_knob_has_flag_help_and_key():
    for knob in knobs():
        assert knob.flag.startswith("--"), knob
        assert len(knob.help) > 20, knob
        assert knob.key, knob


def test_from_config_absent_keys_keep_historical_defaults():
    assert dataclasses.asdict(CkptOptions.from_config({})) == CONFIG_DEFAULTS


def test_from_config_async_save_only_changes_async_save():
    opts = CkptOptions.from_config({"async_save": True})
    assert dataclasses.asdict(opts) == {**CONFIG_DEFAULTS, "async_save": True}


def test_from_config_overrides_every_nemo_rl_key():
    cfg = {"async_save": True, "fully_parallel_save": False, "fully_parallel_load": False,
           "load_rng": True, "distributed_timeout_minutes": 60, "check_for_nan_in_grad": False,
           "logging_level": 20}
    opts = CkptOptions.from_config(cfg)
    assert (opts.async_save, opts.ckpt_fully_parallel_save, opts.ckpt_fully_parallel_load,
            opts.load_rng, opts.distributed_timeout_minutes, opts.check_for_nan_in_grad,
            opts.logging_level) == (True, False, False, True, 60, False, 20)


def test_from_config_reads_every_knob_by_its_key():
    for knob in knobs():
        default = getattr(CkptOptions(), knob.name)
        value = ((not default) if isinstance(default, bool)
                 else knob.choices[-1] if knob.choices
                 else knob.maximum if knob.maximum is not None and knob.maximum < 3 else 3)
        assert getattr(CkptOptions.from_config({knob.key: value}), knob.name) == value, knob.key


def test_unknown_config_key_names_it_and_the_closest_valid_one():
    with pytest.raises(CkptOptionsError, match=r"unknown checkpoint config key 'fully_paralel_save'.*did you mean 'fully_parallel_save'"):
        CkptOptions.from_config({"fully_paralel_save": True})


def test_unknown_keys_can_be_ignored_for_a_full_megatron_cfg():
    opts = CkptOptions.from_config({"tensor_model_parallel_size": 2, "async_save": True}, extra="ignore")
    assert opts.async_save is True


@pytest.mark.parametrize("typo,ours", [
    ("async_sav", "async_save"), ("asyncsave", "async_save"), ("async-save", "async_save"),
    ("Async_Save", "async_save"), ("ASYNC-SAVE", "async_save"), ("fully_paralel_save", "fully_parallel_save"),
    ("load_rgn", "load_rng"), ("ckpt_timout", "ckpt_timeout"), ("dist-ckpt-workers", "dist_ckpt_workers"),
    ("async_ckpt_use_shm", "async_ckpt_use_cpu_shm"), ("distributed_timeout_minute", "distributed_timeout_minutes"),
    ("use_persistent_ckpt_workers", "use_persistent_ckpt_worker"),
    ("exit_on_missing_ckpt", "exit_on_missing_checkpoint"),
])
def test_ignore_still_rejects_a_misspelt_knob_naming_ours(typo, ours):
    with pytest.raises(CkptOptionsError, match=rf"unknown checkpoint config key '{typo}'; did you mean '{ours}'\?"):
        CkptOptions.from_config({typo: True, "tensor_model_parallel_size": 1}, extra="ignore")


# Megatron-LM's argument names for our knobs: a user copying them into a megatron_cfg gets our key
# instead of a silently dropped setting (we do not accept a second spelling).
@pytest.mark.parametrize("megatron_name,ours", [
    ("ckpt_fully_parallel_save", "fully_parallel_save"), ("ckpt_fully_parallel_load", "fully_parallel_load"),
    ("check_for_nan_in_loss_and_grad", "check_for_nan_in_grad"),
])
def test_megatron_lm_argument_names_are_rejected_naming_our_key(megatron_name, ours):
    with pytest.raises(CkptOptionsError, match=rf"'{megatron_name}'; did you mean '{ours}'\?"):
        CkptOptions.from_config({megatron_name: False}, extra="ignore")


def test_negative_flag_as_a_key_says_the_sense_is_opposite():
    with pytest.raises(CkptOptionsError, match=r"did you mean 'load_rng'\? \(--no-load-rng as a key has "
                       r"the opposite sense: write 'load_rng: false'\)"):
        CkptOptions.from_config({"no_load_rng": True}, extra="ignore")


# policy.megatron_cfg of NVIDIA-NeMo/RL examples/configs/grpo_math_1B_megatron.yaml (commit 00294d9),
# with the keys grpo_math_1B.yaml adds (defer_fp32_logits, fp8_cfg, env_vars) and the later
# MegatronConfig fields of nemo_rl/models/policy (bias_activation_fusion ... peft).
NEMO_RL_MEGATRON_CFG = """
policy:
  precision: "bfloat16"
  megatron_cfg:
    enabled: true
    empty_unused_memory_level: 0
    activation_checkpointing: false
    converter_type: "Qwen2ForCausalLM"
    tensor_model_parallel_size: 1
    expert_tensor_parallel_size: 1
    expert_model_parallel_size: 1
    pipeline_model_parallel_size: 1
    num_layers_in_first_pipeline_stage: null
    num_layers_in_last_pipeline_stage: null
    context_parallel_size: 1
    pipeline_dtype: ${policy.precision}
    sequence_parallel: false
    freeze_moe_router: true
    moe_router_dtype: "fp64"
    moe_router_load_balancing_type: "none"
    moe_router_bias_update_rate: 0.0
    moe_permute_fusion: false
    apply_rope_fusion: True
    defer_fp32_logits: null
    bias_activation_fusion: True
    force_overwrite_initial_ckpt: false
    moe_per_layer_logging: false
    moe_enable_deepep: false
    moe_token_dispatcher_type: "allgather"
    moe_shared_expert_overlap: false
    gradient_accumulation_fusion: false
    peft: {enabled: false}
    optimizer:
      optimizer: "adam"
      lr: 5.0e-6
      min_lr: 5.0e-7
      weight_decay: 0.01
      bf16: true
      fp16: false
      params_dtype: "float32"
      adam_beta1: 0.9
      adam_beta2: 0.999
      adam_eps: 1e-8
      sgd_momentum: 0.9
      use_distributed_optimizer: true
      use_precision_aware_optimizer: true
      clip_grad: 1.0
    scheduler:
      start_weight_decay: 0.01
      end_weight_decay: 0.01
      weight_decay_incr_style: "constant"
      lr_decay_style: "constant"
      lr_decay_iters: 1000
      lr_warmup_iters: 13
      lr_warmup_init: 5.0e-7
    distributed_data_parallel_config:
      grad_reduce_in_fp32: false
      overlap_grad_reduce: true
      overlap_param_gather: true
      average_in_collective: true
      use_custom_fsdp: false
      data_parallel_sharding_strategy: "optim_grads_params"
    fp8_cfg: null
    env_vars: null
    async_save: true
    load_rng: true
"""


def test_a_real_nemo_rl_megatron_cfg_loads_with_ignore(tmp_path):
    cfg = tmp_path / "grpo_math_1B_megatron.yaml"
    cfg.write_text(NEMO_RL_MEGATRON_CFG)
    opts = CkptOptions.from_yaml(cfg, extra="ignore")
    assert (opts.async_save, opts.load_rng, opts.ckpt_fully_parallel_load) == (True, True, True)


# The Megatron-LM 0.19 arguments and config fields most similar to our keys (difflib ratio 0.70-0.82
# against some spelling of ours; measured over its ~975 names): a Megatron-style config that holds
# them must load. A looser typo cutoff would reject them.
MEGATRON_LM_NEIGHBOURS = [
    "async_strategy", "calc_ft_timeouts", "check_for_large_grads", "check_for_nan_in_loss",
    "ckpt_fully_parallel_load_exchange_algo", "ckpt_fully_parallel_load_process_group",
    "ckpt_fully_parallel_save_deprecated", "ckpt_fully_parallel_save_process_group",
    "dist_ckpt_format", "dist_ckpt_strictness", "distributed_timeout_seconds_after_init",
    "non_persistent_ckpt_type", "num_distributed_optimizer_instances", "ckpt_format",
    "use_dist_ckpt", "save_interval", "save", "load", "log_level",
]


def test_host_keys_close_to_ours_are_still_ignored():
    opts = CkptOptions.from_config({**{k: 1 for k in MEGATRON_LM_NEIGHBOURS}, "async_save": True},
                                   extra="ignore")
    assert opts.async_save is True


def test_yaml_errors_name_the_file_and_section(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(NEMO_RL_MEGATRON_CFG.replace("async_save: true", "async-save: true"))
    with pytest.raises(CkptOptionsError, match=r"run\.yaml \(policy\.megatron_cfg\): unknown checkpoint "
                       r"config key 'async-save'; did you mean 'async_save'\?"):
        CkptOptions.from_yaml(cfg, extra="ignore")
    cfg.write_text("megatron_cfg:\n  dist_ckpt_workers: 0\n")
    with pytest.raises(CkptOptionsError, match=r"run\.yaml \(megatron_cfg\): --dist-ckpt-workers .* >= 1, got 0"):
        CkptOptions.from_yaml(cfg)


@pytest.mark.parametrize("key,value,expected", [
    ("async_save", "yes", "true or false"),
    ("async_save", 1, "true or false"),
    ("dist_ckpt_workers", "2", "an integer >= 1"),
    ("dist_ckpt_workers", 2.5, "an integer >= 1"),
    ("dist_ckpt_workers", True, "an integer >= 1"),
])
def test_wrong_type_names_key_value_and_expected_type(key, value, expected):
    with pytest.raises(CkptOptionsError) as e:
        CkptOptions.from_config({key: value})
    msg = str(e.value)
    assert f"'{key}'" in msg and repr(value) in msg and expected in msg


@pytest.mark.parametrize("field,value,flag", [
    ("dist_ckpt_workers", 0, "--dist-ckpt-workers"),
    ("dist_ckpt_workers", -3, "--dist-ckpt-workers"),
    ("distributed_timeout_minutes", -1, "--distributed-timeout-minutes"),
    ("distributed_timeout_minutes", 0, "--distributed-timeout-minutes"),
    ("async_ckpt_io_priority", 8, "--async-ckpt-io-priority"),
    ("logging_level", 99, "--logging-level"),
    ("ckpt_timeout", 0, "--ckpt-timeout"),
])
def test_out_of_range_error_names_flag_and_valid_range(field, value, flag):
    with pytest.raises(CkptOptionsError, match=rf"{flag} .* must be an integer (>=|in) .*got {value}"):
        CkptOptions(**{field: value})


def test_yaml_file_top_level_and_megatron_cfg_section(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("async_save: true\nfully_parallel_load: false\n")
    assert CkptOptions.from_yaml(flat).ckpt_fully_parallel_load is False
    nested = tmp_path / "nemo.yaml"
    nested.write_text("policy:\n  megatron_cfg:\n    async_save: true\n    load_rng: true\n"
                      "    tensor_model_parallel_size: 1\n")
    opts = CkptOptions.from_yaml(nested, extra="ignore")
    assert (opts.async_save, opts.load_rng) == (True, True)


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("async_save: true\nfully_parallel_save: [true\nload_rng: false\n")
    with pytest.raises(CkptOptionsError, match=r"malformed YAML in .*bad\.yaml line \d+"):
        CkptOptions.from_yaml(bad)


def test_missing_yaml_file_is_a_clear_error(tmp_path):
    with pytest.raises(CkptOptionsError, match="config file not found"):
        CkptOptions.from_yaml(tmp_path / "nope.yaml")


def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- async_save\n")
    with pytest.raises(CkptOptionsError, match="expected a mapping"):
        CkptOptions.from_yaml(f)


@pytest.mark.parametrize("text,found,want", [
    ("policy:\n  megatron_config:\n    async_save: true\n  generation: {x: 1}\n",
     "policy.megatron_config", "policy.megatron_cfg"),
    ("megatron_config:\n  async_save: true\n", "megatron_config", "megatron_cfg"),
])
def test_a_misspelt_section_is_an_error_naming_the_closest(tmp_path, text, found, want):
    """Every knob of a misspelt section would be dropped silently (defaults, exit 0)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    for extra in ("ignore", "error"):
        with pytest.raises(CkptOptionsError) as e:
            CkptOptions.from_yaml(cfg, extra=extra)
        assert str(cfg) in str(e.value) and f"It has '{found}': did you mean '{want}'?" in str(
            e.value), str(e.value)


@pytest.mark.parametrize("text", ["", "# nothing\n", "{}\n"])
def test_an_empty_config_file_is_an_error_naming_it(tmp_path, text):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text(text)
    with pytest.raises(CkptOptionsError, match=r"empty\.yaml: the config file is empty\. Fix:"):
        CkptOptions.from_yaml(cfg, extra="ignore")


@pytest.mark.parametrize("value", ["0", "-5"])
def test_most_recent_k_out_of_range_is_an_argparse_error_with_the_fix(value, capsys):
    """0 (it would delete the newest checkpoint) is refused like -5: one usage line, no
    traceback."""
    import argparse

    from megatron_ckpt_ext import add_arguments

    with pytest.raises(SystemExit) as e:
        add_arguments(argparse.ArgumentParser()).parse_args(["--most-recent-k", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --most-recent-k: must be an integer (-1 to keep every checkpoint, or K >= " \
           f"1 to keep the K newest), got {value}" in err, err
    with pytest.raises(CkptOptionsError, match=r"--most-recent-k \(config key 'most_recent_k'\)"):
        CkptOptions.from_config({"most_recent_k": int(value)})


def test_ckpt_max_consecutive_failures_takes_one_or_more(capsys):
    import argparse

    from megatron_ckpt_ext import add_arguments

    for bad in (0, -1):
        with pytest.raises(CkptOptionsError, match=r"--ckpt-max-consecutive-failures .* >= 1"):
            CkptOptions(ckpt_max_consecutive_failures=bad)
    with pytest.raises(SystemExit):
        add_arguments(argparse.ArgumentParser()).parse_args(
            ["--ckpt-max-consecutive-failures", "0"])
    assert "--ckpt-max-consecutive-failures" in capsys.readouterr().err
    assert CkptOptions(ckpt_max_consecutive_failures=1).ckpt_max_consecutive_failures == 1
