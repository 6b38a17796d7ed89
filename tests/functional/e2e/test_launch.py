"""``python -m megatron_ckpt_ext.launch SCRIPT ARGS``: an unmodified Megatron-LM script gets our
flags through Megatron's own parser, with the adapter installed.

megatron.training does not import here (megatron-core 0.16.1 lacks it; 0.19.2's needs triton), so
each test lays out a Megatron-LM checkout in tmp_path: the script (``_launch_standin.py``, parsing
as core_r0.19.0's pretrain_gpt.py does) next to a stand-in ``megatron/training`` built from the
seams recorded from 0.19.2's real sources (tests/unit/test_backend_mlm.py), whose
``arguments.parse_args`` / ``parse_and_validate_args`` parse ``sys.argv`` with argparse as
Megatron's do. ``megatron.training`` is importable only from the script's directory, as in a
checkout. Every launch is a subprocess with a hard timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests._support.jobs import run_job

from megatron_ckpt_ext import backend

ROOT = Path(__file__).resolve().parents[3]
STANDIN = Path(__file__).with_name("_launch_standin.py")
TIMEOUT = 120
OUR_FLAGS = ["--async-save", "--async-ckpt-use-cpu-shm", "--dist-ckpt-workers", "3",
             "--ckpt-assume-constant-structure"]

# megatron/training/__init__.py of the checkout: 0.19.2's seams (the adapter's install() probes
# them), and a parser like Megatron's (parse_args calls the provider, then parses sys.argv).
MEGATRON_TRAINING = '''\
import argparse
import sys

from tests._support.mlm_seams import RECORDED, modules_from

_ARGS = {}


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--save", type=str, default=None)
    parser.add_argument("--train-iters", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--tokenizer-type", type=str, default=None)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args()[0]
    return parser.parse_args()


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False,
                            args_defaults={}):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    for key, value in args_defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    _ARGS["args"] = args
    return args


_modules = modules_from(RECORDED["0.19.2"])
_modules["arguments"].parse_args = parse_args
_modules["arguments"].parse_and_validate_args = parse_and_validate_args
_modules["checkpointing"].get_args = lambda: _ARGS["args"]
for _short, _module in _modules.items():
    sys.modules[f"{__name__}.{_short}"] = _module
    globals()[_short] = _module
'''


def _checkout(tmp_path: Path, *, with_megatron: bool = True) -> Path:
    """A Megatron-LM checkout: the script, and (optionally) megatron/training next to it."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    script = checkout / "pretrain_gpt.py"
    shutil.copy(STANDIN, script)
    if with_megatron:
        package = checkout / "megatron" / "training"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(MEGATRON_TRAINING)
    return script


def _launch(tmp_path: Path, *argv: str, prefix: tuple[str, ...] = (), **env: str
            ) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    full_env.update(PYTHONPATH=pythonpath, CUDA_VISIBLE_DEVICES="",
                    STANDIN_RECORD=str(tmp_path / "record.json"), **env)
    cmd = [sys.executable, *prefix, "-m", "megatron_ckpt_ext.launch", *argv]
    return run_job(cmd, cwd=tmp_path, env=full_env, timeout=TIMEOUT, check=False)


def _record(tmp_path: Path, rank: int = 0) -> dict:
    return json.loads((tmp_path / f"record.json.{rank}").read_text())


def _info_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "adapter installed" in line]


def test_unmodified_script_runs_as_main_and_megatrons_parser_takes_our_flags(tmp_path):
    script = _checkout(tmp_path)
    args = ["--train-iters", "5", *OUR_FLAGS]
    proc = _launch(tmp_path, str(script), *args)
    assert proc.returncode == 0, proc.stderr
    seen = _record(tmp_path)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(script), *args]
    assert seen["path0"] == str(script.parent)  # where `import megatron` found the checkout
    assert seen["installed"] is True and seen["proxy"] == "_DistCheckpointingProxy"
    parsed = seen["args"]
    assert parsed["async_ckpt_use_cpu_shm"] is True and parsed["dist_ckpt_workers"] == 3
    assert parsed["ckpt_assume_constant_structure"] is True and parsed["async_save"] is True
    assert parsed["train_iters"] == 5 and parsed["tokenizer_type"] == "GPT2BPETokenizer"
    lines = _info_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("INFO "), proc.stderr
    assert "arguments.parse_and_validate_args" in lines[0] and str(script) in lines[0]


def test_the_scripts_own_extra_args_provider_is_chained_before_ours(tmp_path):
    script = _checkout(tmp_path)
    proc = _launch(tmp_path, str(script), "--my-flag", "7", *OUR_FLAGS, STANDIN_PROVIDER="own")
    assert proc.returncode == 0, proc.stderr
    parsed = _record(tmp_path)["args"]
    assert parsed["my_flag"] == 7 and parsed["dist_ckpt_workers"] == 3
    assert parsed["async_ckpt_use_cpu_shm"] is True
    assert parsed["ckpt_load_threads"] == 2  # the script's definition of a flag of ours wins


def test_a_script_already_passing_the_adapters_provider_installs_once(tmp_path):
    script = _checkout(tmp_path)
    proc = _launch(tmp_path, str(script), *OUR_FLAGS, STANDIN_PROVIDER="adapter")
    assert proc.returncode == 0, proc.stderr
    seen = _record(tmp_path)
    assert seen["installed"] is True and seen["args"]["dist_ckpt_workers"] == 3
    assert seen["proxy"] == "_DistCheckpointingProxy" and seen["proxied"] == "module"
    assert seen["parse_wrappers"] == 1  # Megatron's parser wrapped once
    assert len(_info_lines(proc.stderr)) == 1


def test_the_scripts_exit_status_is_the_launchers(tmp_path):
    script = _checkout(tmp_path)
    proc = _launch(tmp_path, str(script), STANDIN_EXIT="3")
    assert proc.returncode == 3, proc.stderr
    assert _record(tmp_path)["installed"] is True


def test_an_unknown_flag_is_refused_by_megatrons_parser(tmp_path):
    script = _checkout(tmp_path)
    proc = _launch(tmp_path, str(script), "--no-such-flag")
    assert proc.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in proc.stderr


def test_only_rank_0_logs(tmp_path):
    script = _checkout(tmp_path)
    proc = _launch(tmp_path, str(script), *OUR_FLAGS, RANK="1")
    assert proc.returncode == 0, proc.stderr
    assert _record(tmp_path, rank=1)["installed"] is True
    assert _info_lines(proc.stderr) == []


def test_help_of_the_launcher_names_the_real_command(tmp_path):
    proc = _launch(tmp_path, "--help")
    assert proc.returncode == 0
    assert "torchrun [torchrun options] -m megatron_ckpt_ext.launch SCRIPT" in proc.stdout


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_after_the_script_is_the_scripts_own_with_our_flags(tmp_path, flag):
    """``launch SCRIPT --help`` (as the launcher's usage says): Megatron's help from the
    script's parser, listing our flags, not the launcher's usage."""
    script = _checkout(tmp_path)
    proc = _launch(tmp_path, str(script), "--async-save", flag)
    assert proc.returncode == 0, proc.stderr
    assert "usage: pretrain_gpt.py" in proc.stdout and "Megatron-LM Arguments" in proc.stdout
    assert "--async-ckpt-use-cpu-shm" in proc.stdout and "--ckpt-failure-policy" in proc.stdout
    assert "torchrun [torchrun options]" not in proc.stdout


def test_missing_script_argument_is_a_usage_error(tmp_path):
    proc = _launch(tmp_path)
    assert proc.returncode == 2
    assert "no training script given" in proc.stderr and "-m megatron_ckpt_ext.launch" in proc.stderr


def test_a_script_that_does_not_exist_is_named(tmp_path):
    proc = _launch(tmp_path, "nowhere/pretrain_gpt.py", "--async-save")
    assert proc.returncode == 2
    assert "training script nowhere/pretrain_gpt.py does not exist" in proc.stderr


def test_a_launcher_option_it_lacks_is_named_and_a_double_dash_is_skipped(tmp_path):
    proc = _launch(tmp_path, "--unknown-flag", "pretrain_gpt.py")
    assert proc.returncode == 2
    assert "unknown launcher option --unknown-flag" in proc.stderr, proc.stderr
    proc = _launch(tmp_path, "--", "nowhere/pretrain_gpt.py")
    assert proc.returncode == 2
    assert "training script nowhere/pretrain_gpt.py does not exist" in proc.stderr


def test_a_dependency_megatron_training_lacks_is_named_not_megatron_itself(tmp_path):
    script = _checkout(tmp_path, with_megatron=False)
    package = script.parent / "megatron" / "training"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import triton_nonexistent_dependency\n")
    proc = _launch(tmp_path, str(script), *OUR_FLAGS)
    assert proc.returncode == 1
    assert "imports 'triton_nonexistent_dependency', which is not installed" in proc.stderr, \
        proc.stderr
    assert "install megatron-core >= 0.19" not in proc.stderr


def test_without_megatron_training_the_error_names_the_fix(tmp_path):
    if backend.megatron_training_seams().error is None:
        pytest.skip("megatron.training imports here")
    script = _checkout(tmp_path, with_megatron=False)
    proc = _launch(tmp_path, str(script), *OUR_FLAGS)
    assert proc.returncode == 1
    assert "megatron.training" in proc.stderr and "cannot be imported" in proc.stderr
    assert "install megatron-core >= 0.19" in proc.stderr
    assert not (tmp_path / "record.json.0").exists()  # the script never ran
    assert "Traceback" not in proc.stderr


def test_under_torch_distributed_run(tmp_path):
    script = _checkout(tmp_path)
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1")
    proc = _launch(tmp_path, str(script), *OUR_FLAGS, prefix=launcher)
    assert proc.returncode == 0, proc.stderr
    seen = _record(tmp_path)
    assert seen["rank"] == "0" and seen["name"] == "__main__" and seen["installed"] is True
    assert seen["args"]["async_ckpt_use_cpu_shm"] is True
    assert len(_info_lines(proc.stderr)) == 1


def test_launcher_module_is_importable_without_megatron():
    code = ("import sys, megatron_ckpt_ext.launch; "
            "assert not [k for k in sys.modules if k.startswith('megatron.')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))})



# -- scripts/gpu_launch_check.sh's comparison, on fake Megatron logs -----------------------------
def _megatron_log(path: Path, iterations: range, loss: Callable[[int], float]) -> None:
    lines = ["INFO megatron_ckpt_ext.launch: megatron-ckpt-ext adapter installed (...)"]
    lines += [f" [2025-01-01 00:00:{i:02d}] iteration {i:8d}/      20 | consumed samples: "
              f"{4 * i:12d} | elapsed time per iteration (ms): 50.1 | learning rate: 3.0E-04 | "
              f"global batch size:     4 | lm loss: {loss(i):.6E} | loss scale: 1.0 | grad norm: "
              "1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
              for i in iterations]
    path.write_text("\n".join(lines) + "\n")


def _compare(tmp_path: Path, resume_loss: Callable[[int], float]) -> dict:
    save = tmp_path / "on"
    (save / "iter_0000010").mkdir(parents=True, exist_ok=True)
    (save / "iter_0000010" / "mcx_manifest.json").write_text("{}")
    _megatron_log(tmp_path / "on.log", range(1, 21), lambda i: 10.0 - i / 7)
    _megatron_log(tmp_path / "resume.log", range(11, 21), resume_loss)
    out = tmp_path / "check.json"
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_launch_check.sh"), "--compare",
                    str(tmp_path / "on.log"), str(tmp_path / "resume.log"), str(out), "0", "0",
                    str(save)], check=True, timeout=TIMEOUT, capture_output=True)
    return json.loads(out.read_text())


def test_gpu_check_compares_the_logged_losses_of_11_to_20(tmp_path):
    same = _compare(tmp_path, lambda i: 10.0 - i / 7)
    assert same["resume_bit_identical"] is True and same["mismatches"] == []
    assert same["losses"]["resume"]["11"] == f"{10.0 - 11 / 7:.6E}"
    assert len(same["losses"]["on"]) == 20 and same["resume_started_at_11"] is True
    assert same["saved_by_adapter"] is True and same["adapter_installed_logged"] is True


def _resume_logs_first_two_mean(i: int) -> float:
    """What Megatron 0.19 prints for the resumed run of identical training: its second logged
    loss (12) is the mean of 11 and 12, the accumulator not being reset after the first."""
    loss = lambda j: float(f"{10.0 - j / 7:.6E}")  # noqa: E731
    return (loss(11) + loss(12)) / 2 if i == 12 else 10.0 - i / 7


def test_gpu_check_accepts_megatrons_first_iteration_mean_and_only_it(tmp_path):
    ok = _compare(tmp_path, _resume_logs_first_two_mean)
    assert ok["mismatches"] == [12] and list(ok["explained_mismatches"]) == ["12"], ok
    assert ok["resume_bit_identical"] is True
    # 12 off by more than the rule allows: not explained
    off = _compare(tmp_path, lambda i: _resume_logs_first_two_mean(i) + (1e-4 if i == 12 else 0))
    assert off["explained_mismatches"] == {} and off["resume_bit_identical"] is False


def test_gpu_check_names_an_iteration_whose_loss_differs(tmp_path):
    off = _compare(tmp_path, lambda i: 10.0 - i / 7 + (1e-3 if i == 17 else 0.0))
    assert off["resume_bit_identical"] is False and off["mismatches"] == [17]
