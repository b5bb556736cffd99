"""The HTTP API of ``compactd serve``: the runtime contract for runtimes in any language.

Every route under ``/v1`` answers as the Python client's call of the same name
(``scheduler.client``) does, or as ``compactd status`` does for the status::

    PUT  /v1/sessions/{id}             create the session, or open it (updates envelope, policy)
    GET  /v1/sessions/{id}             status: totals, lease, loop-guard flag, recent runs
    POST /v1/sessions/{id}/messages    append one step's messages (pressure is decided here)
    GET  /v1/sessions/{id}/surface     what the model should see now; ETag = surface version
    POST /v1/sessions/{id}/signal      a pressure signal (de-duplicated)
    POST /v1/sessions/{id}/usage       the provider's own input/output tokens for the last call
    POST /v1/sessions/{id}/compact     a manual compaction, optionally waiting for its result
    POST /v1/sessions/{id}/overflow    the provider said the context overflowed
    GET  /v1/sessions/{id}/history/search?query=&checkpoint=&limit=   recall: search the originals
    GET  /v1/sessions/{id}/history/read?checkpoint=&offset=|cursor=   recall: read them, paged
    GET  /v1/tools                     the recall tools' schemas (OpenAI and Anthropic form)

A runtime polls with ``GET .../surface`` and ``If-None-Match: "<version>"``: one primary-key
read, answered 304 while nothing changed.

**Tenants.** Every ``/v1`` route takes ``Authorization: Bearer <token>``; the token names a
tenant (``api.tokens`` in the YAML file) and a tenant sees only its own sessions: another
tenant's session answers 404 exactly like a missing one, on every route. Session ids are global,
so creating an id another tenant holds answers 404 too (and so tells the caller the id is taken):
give sessions unguessable ids. Tokens are compared as SHA-256 digests in constant time and never
logged.

**Errors** share one body, ``{"error", "message", "field", "index"}``: 401 no or unknown token,
404 no such session (for this tenant), 408 the body did not arrive within ``api.body_timeout_s``,
409 the session exists with another run model, 413 the body is over ``api.max_body_bytes``, 414
or 431 the URL or the headers are over ``middleware.MAX_REQUEST_HEAD_BYTES``, 422
a field is not valid (``field`` names it, e.g. ``body.messages[3].tool_call_id``), 503 the
database or the broker cannot be reached (retry).

One engine and connection pool per server process, and its CPU processes (``api.cpu_processes``),
opened by the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from compactd.scheduler.client import CompactdClient
from compactd.scheduler.http.auth import Tokens
from compactd.scheduler.http.errors import add_error_handlers
from compactd.scheduler.http.middleware import MAX_REQUEST_HEAD_BYTES, BodyLimit, BoundedH11Protocol
from compactd.scheduler.http.routes import add_routes
from compactd.scheduler.http.routes.common import PathSegments
from compactd.scheduler.http.state import Api
from compactd.storage.errors import CompactdError
from compactd.storage.store import Store
from compactd.worker.settings import Config

POOL_SIZE = 10  # per server process; SQLAlchemy may open as many again under a burst


def create_app(config: Config, *, environ: Mapping[str, str] | None = None,
               stopping: asyncio.Event | None = None) -> FastAPI:
    """The API for ``config``; tokens named by environment variables are read now, so a
    missing one stops the server before it listens. ``stopping``, set when the server is told
    to stop, cuts its start-up short."""
    tokens = Tokens.from_config(config.api, environ)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store.from_url(config.database_url, pool_size=POOL_SIZE,
                               statement_cache=config.database.statement_cache)
        try:
            async with CompactdClient(config, store=store) as client:
                app.state.api = Api(config, client)
                await app.state.api.start(stopping=stopping)
                try:
                    yield
                finally:
                    app.state.api.close()
        finally:
            await store.close()

    app = FastAPI(
        title="compactd", version="1",
        summary="Out-of-band context compaction for LLM agent runtimes",
        description=__doc__, lifespan=lifespan,
        docs_url="/docs" if config.api.docs else None,
        redoc_url="/redoc" if config.api.docs else None,
        # A path with a trailing slash is not the route: a 404 naming the route (http_error)
        # rather than a 307 to it, which a client that drops the body on a redirect, or does
        # not follow one, would read as an answer.
        redirect_slashes=False)
    app.state.tokens = tokens
    add_routes(app)
    add_error_handlers(app, config)
    app.add_middleware(BodyLimit, max_bytes=config.api.max_body_bytes,
                       timeout_s=config.api.body_timeout_s)
    app.add_middleware(PathSegments)
    return app


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it listens, and when it is told to stop (``stopping``):
    uvicorn looks at its signals only once the lifespan has started, which can take the
    warm-up's whole bound."""

    def __init__(self, config: uvicorn.Config, stopping: asyncio.Event) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()
        self.stopping = stopping
        self._loop = asyncio.get_running_loop()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.listening.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # A signal handler interrupts the loop's own thread anywhere: the event is set by the
        # loop, on its next turn.
        self._loop.call_soon_threadsafe(self.stopping.set)


async def serve(config: Config, *, host: str, port: int) -> None:
    """Run the API until SIGINT/SIGTERM; prints the address it listens on (port 0: any free)."""
    stopping = asyncio.Event()
    app = create_app(config, stopping=stopping)
    server = _Server(uvicorn.Config(
        app, host=host, port=port, lifespan="on", log_config=None, server_header=False,
        proxy_headers=False, http=BoundedH11Protocol,
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES), stopping)
    serving = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait({serving, listening}, return_when=asyncio.FIRST_COMPLETED)
    if server.listening.is_set() and not stopping.is_set():
        bound = server.servers[0].sockets[0].getsockname()
        # Tests and supervisors read the port from this line when they asked for port 0.
        sys.stdout.write(f"compactd API listening on http://{bound[0]}:{bound[1]}\n")
        sys.stdout.flush()
    else:
        listening.cancel()
    await serving
    if not server.listening.is_set():
        raise CompactdError("the API did not start (see the log above)")
