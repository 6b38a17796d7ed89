"""The load path's roles: finding the committed checkpoint to read (locate)."""

from __future__ import annotations

from .locate import locate

__all__ = ["locate"]
