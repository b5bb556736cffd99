"""``from compactd.client import CompactdClient``: the runtime's client under a short name.

The compactd namespace's own modules live here, in scheduler/public/ (mapped to ``compactd`` by
pyproject's package-dir), rather than in a folder of their own at the repository's top: this
module only names what a runtime imports; the client itself is :mod:`scheduler.client`.
"""

from __future__ import annotations

from compactd.scheduler.client import (
    Client,
    CompactdClient,
    OverflowResult,
    SessionHandle,
    StepResult,
    SyncSession,
    WaitTimeout,
)
from compactd.storage.errors import CompactdError, InvalidMessage, SessionNotFound
from compactd.worker.settings import Config, load_config

__all__ = [
    "Client",
    "CompactdClient",
    "CompactdError",
    "Config",
    "InvalidMessage",
    "OverflowResult",
    "SessionHandle",
    "SessionNotFound",
    "StepResult",
    "SyncSession",
    "WaitTimeout",
    "load_config",
]
