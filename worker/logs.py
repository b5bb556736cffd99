"""One logging style for every process: stdlib ``logging`` with ``extra={"action": ...}``.

JSON lines in production (``COMPACTD_LOG_FORMAT=json``, or ``auto`` when stderr is not a
terminal), readable ``key=value`` text on a terminal. Fields set with :func:`bind` (the session
and run ids of the compaction being worked on) are added to every line logged in that context, so
every line of a run carries them. Prompt text, provider bodies and keys are never logged at INFO;
they are not passed to the logger at all except at DEBUG.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "compactd_log_context", default=None)
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime",
                                                                        "taskName"}


@contextlib.contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Add ``fields`` to every log line emitted inside the block (and its tasks)."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield
    finally:
        _context.reset(token)


def push(**fields: Any) -> contextvars.Token[dict[str, Any] | None]:
    """:func:`bind` for code that cannot wrap a block (signal handlers): undo with :func:`pop`
    in the same thread."""
    return _context.set({**(_context.get() or {}), **fields})


def pop(token: contextvars.Token[dict[str, Any] | None]) -> None:
    _context.reset(token)


def bind_more(**fields: Any) -> None:
    """Add ``fields`` to the current context until its :func:`bind` or :func:`push` ends."""
    _context.set({**(_context.get() or {}), **fields})


def bound() -> dict[str, Any]:
    return dict(_context.get() or {})


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "level": record.levelname.lower(), "logger": record.name,
            "msg": record.getMessage(), **_fields(record)}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        extras = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if extras:
            line += f"  [{extras}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(fmt: str = "auto", level: str = "INFO", stream: Any = None) -> None:
    """Install the compactd handler on the root logger (idempotent)."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "text" if getattr(stream, "isatty", lambda: False)() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    handler.set_name("compactd")
    root = logging.getLogger()
    for existing in list(root.handlers):
        if existing.get_name() == "compactd":
            root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries that log request bodies or headers at INFO/DEBUG stay at WARNING.
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2", "openai", "anthropic", "asyncio",
                  "aiosqlite"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
