"""Imports and versions that never raise: the module names of the backends, a failed import as a
message, the version of the copy actually imported (for messages only)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import BackendUnavailable

NVRX = "nvidia_resiliency_ext"
NVRX_DIST = "nvidia-resiliency-ext"
MCORE_DIST = "megatron-core"
NVRX_ASYNC = f"{NVRX}.checkpointing.async_ckpt"
MCORE_DC = "megatron.core.dist_checkpointing"
MCORE_STRATEGIES = f"{MCORE_DC}.strategies"
# The nvrx release from which megatron-core 0.19 accepts nvrx at import time.
MCORE_019_NVRX_MIN = "0.6.0"


def _dist_version_near(module_dir: Path, dist: str) -> str | None:
    """The version of ``dist`` installed next to ``module_dir`` (the copy actually imported)."""
    prefix = dist.replace("-", "_").lower() + "-"
    for info in sorted(module_dir.parent.glob("*.dist-info")):
        if info.name.lower().startswith(prefix):
            return info.name[len(prefix):-len(".dist-info")]
    return None


# A source tree (a git checkout, no dist-info next to it) states its version in this file; the
# metadata of another installed copy would name the wrong one.
_SOURCE_VERSION_FILES = {"megatron": "core/package_info.py"}
_SOURCE_VERSION_PART = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([\w.]*)['\"]?\s*$",
                                  re.M)


def _copies(locations: list[str], top: str) -> list[str]:
    """The locations of a (namespace) package that hold the copy imported first: ``megatron`` is
    a namespace package, and ``megatron.core`` comes from the first of its folders that has it."""
    rel = _SOURCE_VERSION_FILES.get(top)
    anchor = rel.split("/")[0] if rel else None
    return [loc for loc in locations if anchor is None or (Path(loc) / anchor).is_dir()]


def _source_version(module_dir: Path, top: str) -> str | None:
    """``MAJOR.MINOR.PATCH[PRE_RELEASE]+src`` read (not imported) from a source tree's
    package_info; None where there is none."""
    rel = _SOURCE_VERSION_FILES.get(top)
    try:
        text = (module_dir / rel).read_text() if rel else ""
    except OSError:
        return None
    parts = dict(_SOURCE_VERSION_PART.findall(text))
    if not all(k in parts for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}+src"


def _installed_version(top: str, dist: str) -> str | None:
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in _copies(spec.submodule_search_locations or [], top)[:1]:
        version = _dist_version_near(Path(location), dist) or _source_version(Path(location), top)
        if version:
            return version
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _version_tuple(version: str | None) -> tuple[int, ...]:
    parts = re.findall(r"\d+", version or "")[:3]
    return tuple(int(p) for p in parts)


def _try_import(name: str) -> tuple[ModuleType | None, str | None]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name), None
    except BaseException as e:  # noqa: BLE001 - an old backend may raise anything at import
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return None, f"{type(e).__name__}: {e}".strip()


def _attr(module: ModuleType | None, *names: str) -> Any:
    for name in names:
        value = getattr(module, name, None) if module is not None else None
        if value is not None:
            return value
    return None


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    except Exception:  # noqa: BLE001 - a parent package that fails to import
        return False


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"cannot import {name}: {type(e).__name__}: {e}") from e
