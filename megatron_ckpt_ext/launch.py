"""Run an unmodified Megatron-LM training script with the adapter installed.

    torchrun --nproc-per-node N -m megatron_ckpt_ext.launch pretrain_gpt.py <Megatron args and ours>

Steps, on every rank, before the script runs:

1. ``sys.argv`` becomes ``[script, *args]`` and ``sys.path[0]`` the script's directory, as
   ``python script.py`` would set them (a Megatron-LM checkout's ``megatron/`` sits next to
   ``pretrain_gpt.py``, so ``megatron.training`` is looked up only after this);
2. :func:`megatron_ckpt_ext.megatron_lm.install` routes Megatron's checkpointing through the
   Checkpointer (idempotent: a script that installs again changes nothing);
3. Megatron's argument parser (``arguments.parse_and_validate_args``, or ``parse_args`` where
   ``pretrain`` parses) is wrapped wherever ``megatron.training`` binds it, so that every call
   adds our flags after the script's own ``extra_args_provider`` (or alone, when it passes none);
4. the script runs as ``__main__`` (``runpy.run_path``); its ``SystemExit`` is the exit status.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import runpy
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from . import backend, megatron_lm
from .errors import MegatronAdapterError

__all__ = ["USAGE", "LaunchError", "main"]

logger = logging.getLogger("megatron_ckpt_ext.launch")  # __name__ is "__main__" under -m

USAGE = """\
usage: torchrun [torchrun options] -m megatron_ckpt_ext.launch SCRIPT [ARGS ...]
       python -m megatron_ckpt_ext.launch SCRIPT [ARGS ...]

Run a Megatron-LM training script (e.g. pretrain_gpt.py) unmodified, with megatron-ckpt-ext's
checkpointing installed: ARGS are the script's (Megatron's flags and ours, such as --async-save
--async-ckpt-use-cpu-shm --dist-ckpt-workers 2); Megatron's own parser accepts ours, after the
script's extra_args_provider if it has one. `SCRIPT --help` prints Megatron's help with our flags.

options:
  -h, --help  show this message and exit (only before SCRIPT)
"""


class LaunchError(Exception):
    """The launcher cannot start the script; ``exit_code`` is the process's exit status."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m megatron_ckpt_ext.launch``; exits with the script's status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    try:
        script, args = _script_and_args(argv)
        _enter_script_context(script, args)
        hooked = _install()
    except LaunchError as e:
        print(f"megatron_ckpt_ext.launch: error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    _log_installed(script, hooked)
    runpy.run_path(str(script), run_name="__main__")


def _script_and_args(argv: list[str]) -> tuple[Path, list[str]]:
    if argv and argv[0] == "--":  # the usual end of options: the script follows
        argv = argv[1:]
    if not argv:
        raise LaunchError(f"no training script given\n{USAGE}", exit_code=2)
    if argv[0].startswith("-"):
        raise LaunchError(f"unknown launcher option {argv[0]}: the launcher takes only -h/--help"
                          " before the script; the script's own flags go after its path\n"
                          f"{USAGE}", exit_code=2)
    script = Path(argv[0])
    if not script.is_file():
        what = "is a directory" if script.is_dir() else "does not exist"
        raise LaunchError(f"training script {argv[0]} {what} (cwd {os.getcwd()}): pass the path "
                          "of Megatron-LM's pretrain_gpt.py or your own script", exit_code=2)
    return script, argv[1:]


def _enter_script_context(script: Path, args: list[str]) -> None:
    """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` would set them. The entry
    replaced (the working directory of ``-m``) stays second where this package was found there
    only: spawned writers re-import it from the parent's ``sys.path``."""
    sys.argv = [str(script), *args]
    directory = str(script.resolve().parent)
    replaced = sys.path[0] if sys.path else None
    sys.path[:1] = [directory]
    if replaced is not None and _is_our_root(replaced):
        sys.path.insert(1, replaced)


def _is_our_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == Path(__file__).resolve().parents[1]
    except OSError:
        return False


def _install() -> str:
    """Install the adapter and wrap Megatron's parser; returns the wrapped function's name."""
    seams = backend.megatron_training_seams()
    if seams.error is not None:
        missing = re.search(r"No module named '([^']+)'", seams.error)
        if missing and not missing.group(1).startswith("megatron"):  # present, a dependency not
            raise LaunchError(
                f"{seams.describe_problem()}. megatron.training is there but imports "
                f"'{missing.group(1)}', which is not installed. Fix: install it (Megatron-LM's "
                "requirements list its dependencies).", exit_code=1)
        raise LaunchError(
            f"{seams.describe_problem()}. Fix: install megatron-core >= 0.19 (it ships "
            "megatron.training), or run a script that sits in a Megatron-LM checkout (its "
            "megatron/ folder next to the script), or put the checkout on PYTHONPATH.",
            exit_code=1)
    if seams.parse_args_fn is None:
        raise LaunchError(
            f"megatron.training of megatron-core {seams.mcore_version} has no argument parser "
            "taking extra_args_provider (arguments.parse_and_validate_args or parse_args); "
            "pass megatron_ckpt_ext.megatron_lm.extra_args_provider in your script instead.",
            exit_code=1)
    try:
        megatron_lm.install()
    except MegatronAdapterError as e:
        raise LaunchError(str(e), exit_code=1) from e
    _wrap_parser(seams.parse_args_fn)
    return seams.parse_args_fn


def _wrap_parser(qualified: str) -> None:
    """Replace ``megatron.training.<qualified>`` in every module that binds it (``initialize``
    imports ``parse_args`` by name)."""
    short, name = qualified.split(".")
    parse = getattr(backend.megatron_training_module(short), name)
    wrapped = _with_our_flags(parse)
    for module_name in backend.MLM_MODULES:
        module = backend.megatron_training_module(module_name)
        for attr, value in list(vars(module).items()):
            if value is parse:
                setattr(module, attr, wrapped)


def _with_our_flags(parse: Callable[..., Any]) -> Callable[..., Any]:
    """``parse`` whose ``extra_args_provider`` (its first parameter in every Megatron-LM release
    with one) is chained with ours."""

    @functools.wraps(parse)
    def parse_with_our_flags(extra_args_provider: Callable[[Any], Any] | None = None,
                             *args: Any, **kwargs: Any) -> Any:
        return parse(_chain(extra_args_provider), *args, **kwargs)

    return parse_with_our_flags


def _chain(user: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The script's provider first (its flags win), then ours (skips flags already defined)."""
    if user is None or user is megatron_lm.extra_args_provider:
        return megatron_lm.extra_args_provider

    def provider(parser: Any) -> Any:
        return megatron_lm.extra_args_provider(user(parser))

    return provider


def _log_installed(script: Path, hooked: str) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():  # nothing configured yet (the script configures its own later)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.info("megatron-ckpt-ext adapter installed (megatron.training.%s takes our flags); "
                "running %s", hooked, script)


if __name__ == "__main__":
    main()
