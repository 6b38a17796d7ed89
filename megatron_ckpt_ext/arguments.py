"""The argparse group, derived from ``options.py``; usable as Megatron's ``extra_args_provider``.

Registration is idempotent and host-aware: a flag the host parser (any Megatron-LM version)
already defines is not added again, argparse's conflict error is never raised, and the host's
``dest`` is recorded so :meth:`CkptOptions.from_args` reads the right attribute.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ._threads import AUTO
from .options import _DESTS_ATTR, _INVERTED, Knob, _field_default, _range_text, knobs

__all__ = ["GROUP_TITLE", "add_arguments", "flags"]

GROUP_TITLE = "checkpointing (megatron-ckpt-ext)"


def flags() -> list[str]:
    """Every CLI flag this plugin can register, in declaration order."""
    return [k.flag for k in knobs()]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags to ``parser`` (skipping those it already has) and return it."""
    group = _our_group(parser)
    existing = parser._option_string_actions  # argparse's own registry of option strings
    dests: dict[str, str] = {}
    for knob in knobs():
        host_action = existing.get(knob.flag)
        if host_action is None:
            _add(group, knob)
        elif host_action.dest != knob.arg_dest:
            # a host `--no-x` that stores True (Megatron-LM's --no-save-rng): True means False
            inverted = knob.negative and isinstance(host_action, argparse._StoreTrueAction)
            dests[knob.name] = _INVERTED * inverted + host_action.dest
    if dests:  # only a host whose dest differs from Megatron's leaves a trace in the namespace
        previous = parser.get_default(_DESTS_ATTR) or {}
        parser.set_defaults(**{_DESTS_ATTR: {**previous, **dests}})
    return parser


def _our_group(parser: argparse.ArgumentParser) -> Any:
    for group in parser._action_groups:
        if group.title == GROUP_TITLE:
            return group
    return parser.add_argument_group(GROUP_TITLE)


def _add(group: Any, knob: Knob) -> None:
    default = _field_default(knob.name)
    if knob.negative:
        group.add_argument(knob.flag, action="store_false", dest=knob.arg_dest, help=knob.help)
    elif isinstance(default, bool):
        group.add_argument(knob.flag, action="store_true", dest=knob.arg_dest, help=knob.help)
    elif knob.choices is not None:
        alone = {"nargs": "?", "const": knob.bare} if knob.bare is not None else {}
        group.add_argument(knob.flag, choices=knob.choices, default=default, dest=knob.arg_dest,
                           help=f"{knob.help} (default: {default})", **alone)
    else:
        group.add_argument(
            knob.flag,
            type=_int_type(knob),
            default=default,
            dest=knob.arg_dest,
            metavar=f"{{N,{AUTO}}}" if knob.auto else "N",
            help=f"{knob.help} (default: {default})",
        )


def _int_type(knob: Knob) -> Callable[[str], int | str]:
    def parse(text: str) -> int | str:
        if knob.auto and text == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer{_range_text(knob)}, got {text!r}"
            ) from None
        too_low = knob.minimum is not None and value < knob.minimum
        too_high = knob.maximum is not None and value > knob.maximum
        if too_low or too_high or value in knob.excluded:
            raise argparse.ArgumentTypeError(f"must be an integer{_range_text(knob)}, got {value}")
        return value

    parse.__name__ = "int"
    return parse
