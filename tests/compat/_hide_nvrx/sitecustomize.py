"""Put this directory first on PYTHONPATH to make nvidia-resiliency-ext unimportable.

Used by the compat matrix's "nvrx hidden" pass: a meta-path finder that refuses the package, so
every import of it (and find_spec) fails as if it were not installed.
"""

from __future__ import annotations

import importlib.abc
import sys


class _HideNvrx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "nvidia_resiliency_ext":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the compat matrix)")
        return None


sys.meta_path.insert(0, _HideNvrx())
