"""Which host of a libpq host list a connection goes to, as libpq decides it: in the URL's order
(``load_balance_hosts=disable``, its default), or in a random order drawn for each connection
(``load_balance_hosts=random``). With ``target_session_attrs=prefer-standby`` and no standby,
libpq's second pass takes the first host that accepts; asyncpg's own took a random one, so a
fleet piled onto no host in particular, and no URL could ask for either. Each host here is a
forwarder to the one real PostgreSQL server (a primary: no standby answers) that counts the
connections it carries, and which of them each kept connection came through."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from compactd.storage.errors import ConfigError
from compactd.storage.store import Store

CONNECTIONS = 16


class Forwarder:
    """A TCP port on the loopback that carries each connection to ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.connections = 0
        self.outgoing: set[int] = set()  # the client ports the server sees
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> Forwarder:
        self.server = await asyncio.start_server(self._carry, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        to_reader, to_writer = await asyncio.open_connection(*self.target)
        self.outgoing.add(to_writer.get_extra_info("sockname")[1])

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, to_writer), pipe(to_reader, writer))


@contextlib.asynccontextmanager
async def two_hosts(pg_url: str) -> AsyncIterator[tuple[Forwarder, Forwarder, str]]:
    """Two forwarders to ``pg_url``'s server, and ``pg_url`` through them as a host list."""
    url = sa.engine.make_url(pg_url)
    async with Forwarder(url.host or "127.0.0.1", url.port or 5432) as first, \
            Forwarder(url.host or "127.0.0.1", url.port or 5432) as second:
        password = f":{url.password}" if url.password else ""
        yield first, second, (f"postgresql://{url.username}{password}@127.0.0.1:{first.port},"
                              f"127.0.0.1:{second.port}/{url.database}")


async def connect_fresh(url: str, times: int, *hosts: Forwarder) -> list[int]:
    """``times`` connections of a store, each a new one: the index in ``hosts`` of the host
    each was kept on."""
    store = Store.from_url(url)
    kept = []
    try:
        for _ in range(times):
            async with store.engine.connect() as conn:
                port = await conn.scalar(sa.text("select inet_client_port()"))
            kept += [i for i, host in enumerate(hosts) if port in host.outgoing]
            await store.engine.dispose()
    finally:
        await store.close()
    assert len(kept) == times
    return kept


@pytest.mark.timeout(120)
async def test_prefer_standby_without_a_standby_takes_the_first_host_as_libpq_does(
        clean_pg: str) -> None:
    async with two_hosts(clean_pg) as (first, second, url):
        kept = await connect_fresh(f"{url}?target_session_attrs=prefer-standby", CONNECTIONS,
                                   first, second)
    # Each connection asks both for a standby, then the first in any mode.
    assert (first.connections, second.connections) == (2 * CONNECTIONS, CONNECTIONS)
    assert kept == [0] * CONNECTIONS


@pytest.mark.timeout(120)
async def test_load_balance_hosts_random_spreads_the_connections_over_the_hosts(
        clean_pg: str) -> None:
    async with two_hosts(clean_pg) as (first, second, url):
        kept = await connect_fresh(
            f"{url}?target_session_attrs=prefer-standby&load_balance_hosts=random",
            CONNECTIONS, first, second)
    # Each connection is kept on the host it tried first: all on one host has a chance of
    # one in 2**15.
    assert set(kept) == {0, 1}, kept


def test_a_load_balance_hosts_libpq_does_not_take_is_bad_input() -> None:
    with pytest.raises(ConfigError, match="load_balance_hosts must be one of disable, random, "
                                          "not 'round-robin'"):
        Store.from_url("postgresql://u@db-a,db-b/db?load_balance_hosts=round-robin")
