"""Put this directory on PYTHONPATH and name a megatron-core source tree in ``MCE_MCORE_SOURCE``
(the folder holding its ``megatron/``, first on PYTHONPATH) to import that tree's ``megatron.core``
subpackages without running ``megatron/core/__init__.py``.

Used by the compat matrix's "mcore main" pass. megatron-core main's package ``__init__`` imports
``megatron.core.distributed`` -> ``pipeline_parallel.schedules`` -> ``transformer.moe.paged_stash``
-> ``import triton``, and triton is not installed on this CPU machine (torch's CPU wheel does not
bring it). ``megatron.core.dist_checkpointing`` itself does not need triton: this finder gives
``megatron.core`` as a bare package over the tree's folder, then imports the three modules the
real ``__init__`` imports first (``tensor_parallel``, ``utils``, ``parallel_state``: in another
order they import each other in a circle). Everything the compat layer probes is then main's real
code; only the package ``__init__``'s re-exports (``megatron.core.Timers``, ``mpu``, ...) and its
``torch.storage._load_from_bytes`` override are absent, so ``megatron.training`` still does not
import here (its seams are checked from the sources, tests/compat/test_mcore_main.py).
Any other tree, or any tree where triton is installed, is left alone: nothing is bypassed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_FIRST_IMPORTS = ("tensor_parallel", "utils", "parallel_state")
BYPASSED: list[str] = []  # the megatron/core folders given as bare packages (read by the tests)


class _BareMegatronCore(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core" or not path:
            return None
        for entry in path:
            folder = os.path.join(entry, "core")
            if os.path.isfile(os.path.join(folder, "__init__.py")):
                if not _needs_bypass(folder):
                    return None
                spec = importlib.machinery.ModuleSpec(name, self, is_package=True,
                                                      origin=os.path.join(folder, "__init__.py"))
                spec.submodule_search_locations = [folder]
                return spec
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        BYPASSED.append(module.__spec__.submodule_search_locations[0])
        for short in _FIRST_IMPORTS:
            importlib.import_module(f"megatron.core.{short}")


def _needs_bypass(folder: str) -> bool:
    """Only the named tree, and only where its triton import chain would fail."""
    source = os.environ.get("MCE_MCORE_SOURCE")
    if not source or os.path.realpath(folder) != os.path.realpath(
            os.path.join(source, "megatron", "core")):
        return False
    try:
        return importlib.util.find_spec("triton") is None
    except (ImportError, ValueError):
        return True


sys.meta_path.insert(0, _BareMegatronCore())
