"""Small probes the operations tests share: a free port, a one-shot store query, an HTTP status."""

from __future__ import annotations

import asyncio
import base64
import socket
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import TypeVar

from compactd.storage.store import Store

T = TypeVar("T")


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon after; good enough for tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    """Run ``fn(store)`` on a short-lived store: the test process reads what workers wrote."""

    async def go() -> T:
        store = Store.from_url(url, pool_size=1)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(go())


def http_status(url: str, auth: tuple[str, str] | None = None, timeout: float = 5.0) -> int:
    """The status of a GET (0 when nothing answers)."""
    request = urllib.request.Request(url)
    if auth:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0
