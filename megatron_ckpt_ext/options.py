"""Every checkpointing knob, defined once.

Each field of :class:`CkptOptions` (declared in ``option_table.py``, the knob table) carries a
:class:`Knob` in its metadata: the CLI flag (Megatron's spelling), the argparse ``dest``
(Megatron's), the help text, the config key (NeMo-RL ``megatron_cfg`` spelling) and, where the
config path uses another default (NeMo-RL's), that default. ``arguments.py`` derives the argparse
group from these fields and :meth:`CkptOptions.from_config` derives the config keys; no default is
written twice.

Value checks (types and ranges) live here, in ``__post_init__``, because they hold for every source
(CLI, config, code). Rules that relate several knobs, or a knob and the installed backend, live in
``validation.py``. The diagnostic ``MCX_*`` environment switches are not options: they live in
``debug.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Mapping

from ._threads import AUTO
from .errors import CkptOptionsError
from .option_table import _SAME, Knob, _KnobTable

__all__ = ["CkptOptions", "Knob", "knobs"]


@dataclass(frozen=True, kw_only=True)
class CkptOptions(_KnobTable):
    """Checkpointing options. Build with :meth:`from_args`, :meth:`from_config` or keywords.
    The fields (one per knob, with flag, help and config key) are :mod:`.option_table`'s."""

    def __post_init__(self) -> None:
        if not isinstance(self.exit_signal, str) and hasattr(self.exit_signal, "name"):
            object.__setattr__(self, "exit_signal", self.exit_signal.name)  # Megatron's Signals
        for knob in knobs():
            value = getattr(self, knob.name)
            if knob.bare is not None and isinstance(value, bool):  # a switch once: true / false
                object.__setattr__(self, knob.name, knob.bare if value else "off")
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
            dest = dests.get(knob.name, knob.arg_dest)
            value = getattr(namespace, dest.removeprefix(_INVERTED), _SAME)
            if dest.startswith(_INVERTED) and isinstance(value, bool):  # the host's --no-x: True
                value = not value  # when given (Megatron-LM's --no-save-rng, store_true)
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
_INVERTED = "!"  # a host dest whose True means our knob's False (argparse dests have no "!")


def knobs() -> Iterator[Knob]:
    """The knobs in declaration order, each with its field name filled in."""
    for f in dataclasses.fields(CkptOptions):
        yield dataclasses.replace(f.metadata["knob"], name=f.name)


def _check_value(knob: Knob, value: Any) -> None:
    default = _field_default(knob.name)
    if (value is None and knob.optional) or (knob.auto and value == AUTO):
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
    either = f" or '{AUTO}'" if knob.auto else ""
    if knob.valid is not None:
        return f" ({knob.valid})"
    if knob.minimum is not None and knob.maximum is not None:
        return f" in [{knob.minimum}, {knob.maximum}]{either}"
    if knob.minimum is not None:
        return f" >= {knob.minimum}{either}"
    return either


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
    return msg + ("" if msg.endswith("?") else ".") + f" Valid keys: {', '.join(sorted(by_key))}"


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

