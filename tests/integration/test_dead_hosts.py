"""A database server that stops answering without refusing (a frozen host, a network partition;
what an old primary can be in a failover): each wait on it ends in its bound with the retryable
DatabaseUnavailable, and the next host of a failover URL is tried in its time. asyncpg's own
connect timeout (60 s) bounds all the URL's hosts together, so a silent first host held every
new connection for a minute and the new primary behind it was never reached; a pool whose
connections are all in use kept a caller waiting 30 s and then raised SQLAlchemy's own error."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from compactd.storage import connectors_engines
from compactd.storage.errors import DatabaseUnavailable
from compactd.storage.store import Store

SLACK_S = 3.0  # a loaded machine's connect and statement, beyond the bound


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose TCP connections complete (the kernel's listen backlog) and are never
    answered: nothing accepts them."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def hosts_url(pg_url: str, *ports: int | None, query: str = "") -> str:
    """``pg_url``'s database through a libpq host list: each of ``ports`` on the loopback, None
    standing for ``pg_url``'s own host and port."""
    url = sa.engine.make_url(pg_url)
    hosts = ",".join(f"{url.host}:{url.port or 5432}" if port is None else f"127.0.0.1:{port}"
                     for port in ports)
    password = f":{url.password}" if url.password else ""
    return f"postgresql://{url.username}{password}@{hosts}/{url.database}{query}"


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_a_silent_first_host_is_passed_over_within_the_connect_timeout(
        clean_pg: str, silent_port: int) -> None:
    store = Store.from_url(hosts_url(clean_pg, silent_port, None,
                                     query="?target_session_attrs=read-write"))
    try:
        started = time.monotonic()
        await store.create_session("behind-a-silent-host")
        took = time.monotonic() - started
    finally:
        await store.close()
    assert took < connectors_engines.CONNECT_TIMEOUT_S + SLACK_S, (
        f"the second host was reached after {took:.1f} s")


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_a_silent_server_is_unavailable_within_the_urls_connect_timeout(
        clean_pg: str, silent_port: int) -> None:
    """libpq's connect_timeout in the URL, shorter than the default, is what bounds it."""
    store = Store.from_url(hosts_url(clean_pg, silent_port, query="?connect_timeout=1"))
    try:
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as unavailable:
            await store.create_session("nowhere")
        took = time.monotonic() - started
    finally:
        await store.close()
    assert unavailable.value.retryable
    assert 1 <= took < 1 + SLACK_S < connectors_engines.CONNECT_TIMEOUT_S, (
        f"failed after {took:.1f} s")


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_a_pool_with_no_connection_free_is_unavailable_within_its_timeout(
        clean_pg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection held (as by connects to a server that does not answer): the next
    caller waits the pool's timeout, then gets the retryable error."""
    monkeypatch.setattr(connectors_engines, "POOL_TIMEOUT_S", 1.0, raising=False)
    store = Store.from_url(clean_pg, pool_size=1, max_overflow=0, kept_connections=0)
    try:
        await store.create_session("s1")
        async with store.engine.connect():  # the pool's only connection
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable) as unavailable:
                await store.get_session("s1")
            took = time.monotonic() - started
        assert (await store.get_session("s1")).id == "s1"  # free again: served
    finally:
        await store.close()
    assert unavailable.value.retryable and "free" in str(unavailable.value)
    assert took < 1 + SLACK_S, f"failed after {took:.1f} s"
