"""A TCP proxy in front of PostgreSQL that can lose an answer the server already sent: once
armed, it closes the client's connection where the server's answer holds a CommandComplete
whose tag starts with the armed prefix (``COMMIT``), or with no prefix at the next
ReadyForQuery (the end of the next statement's answer: an autocommit statement has committed
by then), instead of passing it on. The server has done the work and committed; the client
sees its connection drop mid-answer, as it would when a network path or a restarting server
cut it. It counts the answers it passes on (``round_trips``: each ends with a ReadyForQuery, one
per simple query or extended-protocol Sync, so one per round trip a client waits for).

    async with CutProxy(pg_url) as proxy:
        proxy.arm(b"COMMIT")
        ... connect to proxy.url(pg_url) ...
        assert proxy.cuts == 1
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from types import TracebackType
from urllib.parse import urlparse

# The first message of a client that asks for TLS: its server answers with one byte ('N'
# here: the test server speaks plain TCP), not a typed message.
_SSL_REQUEST = struct.pack("!ii", 8, 80877103)
_COMMAND_COMPLETE = ord("C")
_READY_FOR_QUERY = ord("Z")


class CutProxy:
    def __init__(self, target_url: str) -> None:
        parsed = urlparse(target_url)
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 5432
        self._server: asyncio.Server | None = None
        self._armed: bytes | None = None
        self._armed_end = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.cuts = 0
        self.round_trips = 0

    def url(self, target_url: str) -> str:
        """``target_url`` through the proxy."""
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        parsed = urlparse(target_url)
        user = f"{parsed.username}@" if parsed.username else ""
        return parsed._replace(netloc=f"{user}127.0.0.1:{port}").geturl()

    def arm(self, tag: bytes | None = None) -> None:
        """Cut the next answer that completes a command whose tag starts with ``tag``; with
        no tag, the next answer that ends (its ReadyForQuery)."""
        self._armed, self._armed_end = tag, tag is None

    async def __aenter__(self) -> CutProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
        await self._server.wait_closed()

    async def _serve(self, client_in: asyncio.StreamReader,
                     client_out: asyncio.StreamWriter) -> None:
        server_in, server_out = await asyncio.open_connection(self._host, self._port)
        first = await client_in.read(65536)
        server_out.write(first)
        plain_byte = first[:8] == _SSL_REQUEST
        upstream = asyncio.create_task(self._pipe(client_in, server_out))
        downstream = asyncio.create_task(
            self._answers(server_in, client_out, skip_one_byte=plain_byte))
        self._tasks.update((upstream, downstream))
        try:
            await asyncio.wait((upstream, downstream), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (upstream, downstream):
                task.cancel()
                self._tasks.discard(task)
            for writer in (client_out, server_out):
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                       skip_one_byte: bool) -> None:
        """Pass the server's messages on whole, one by one, but the armed one."""
        if skip_one_byte:
            writer.write(await reader.readexactly(1))
        while True:
            head = await reader.readexactly(5)
            body = await reader.readexactly(struct.unpack("!i", head[1:])[0] - 4)
            if (self._armed is not None and head[0] == _COMMAND_COMPLETE
                    and body.startswith(self._armed)) or (
                    self._armed_end and head[0] == _READY_FOR_QUERY):
                self._armed, self._armed_end = None, False
                self.cuts += 1
                return  # the caller closes both connections: the answer is lost
            if head[0] == _READY_FOR_QUERY:
                self.round_trips += 1
            writer.write(head + body)
            await writer.drain()
