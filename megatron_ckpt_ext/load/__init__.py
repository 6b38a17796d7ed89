"""The load path's roles: finding the committed checkpoint to read (locate), and what a load
refuses before it reads (refuse_plain_targets)."""

from __future__ import annotations

from .locate import locate, refuse_plain_targets

__all__ = ["locate", "refuse_plain_targets"]
