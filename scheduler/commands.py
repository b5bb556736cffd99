"""CLI commands beyond the foundation's: registered onto the ``compactd`` parser."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    """Add the compaction, scheduling and operations commands to ``sub``."""
