"""compactd's HTTP API in this process (ASGI, lifespan included) for two tenants, each with its
bearer token, over the test's database.

    async for served in serve_app(api_config(db_url, tmp_path)):
        await served.create("s1", A, context_window=128_000)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from compactd.scheduler.http import API_PREFIX, create_app, token_sha256
from compactd.scheduler.http.state import Api
from compactd.storage.store import PreparedAppend
from compactd.worker.settings import Config, Settings, build_config

TOKEN_A = "token-for-tenant-a-0123456789"
TOKEN_B = "token-for-tenant-b-9876543210"
A = {"Authorization": f"Bearer {TOKEN_A}"}
B = {"Authorization": f"Bearer {TOKEN_B}"}
MAX_BODY = 64 * 1024
# The /v1 routes that name no session (they serve no tenant's data, but still take a token).
SESSIONLESS = {API_PREFIX + "/tools"}


def api_config(database_url: str, home: Path, *, cpu_processes: int = 0, **raw: Any) -> Config:
    """The config of an API over ``database_url``. Its CPU processes (``api.cpu_processes``)
    decode only append bodies over ``OFFLOAD_BYTES``, and each starts a fresh interpreter that
    imports compactd before the app serves: an app per test would wait for one the test never
    uses, so a test that sends such a body asks for them (``cpu_processes`` here, or the
    ``cpu_processes`` mark, :func:`marked_cpu_processes`), and :func:`serve_app` fails one
    that sends it without."""
    broker_url = raw.pop("broker_url", None)
    raw.setdefault("api", {})
    raw["api"] = {"tokens": [{"tenant": "tenant-a", "token_sha256": token_sha256(TOKEN_A)},
                             {"tenant": "tenant-b", "token_sha256": token_sha256(TOKEN_B)}],
                  "max_body_bytes": MAX_BODY, "max_wait_s": 0.5,
                  "cpu_processes": cpu_processes, **raw["api"]}
    return build_config(raw, settings=Settings(database_url=database_url, home=str(home),
                                               broker_url=broker_url), home=home)


class Served:
    def __init__(self, app: FastAPI, http: httpx.AsyncClient) -> None:
        self.app = app
        self.http = http

    async def create(self, session: str, headers: dict[str, str], **body: Any) -> None:
        response = await self.http.put(f"/v1/sessions/{session}", headers=headers, json=body)
        assert response.status_code == 201, response.text

    async def append(self, session: str, headers: dict[str, str],
                     *messages: dict[str, Any]) -> httpx.Response:
        return await self.http.post(f"/v1/sessions/{session}/messages", headers=headers,
                                    json={"messages": list(messages)})


def marked_cpu_processes(request: pytest.FixtureRequest) -> int:
    """The CPU processes the test's ``cpu_processes(n)`` mark asks for; 0 without one."""
    mark = request.node.get_closest_marker("cpu_processes")
    return int(mark.args[0]) if mark else 0


async def serve_app(config: Config) -> AsyncIterator[Served]:
    app = create_app(config)
    async with app.router.lifespan_context(app):
        offloaded = _count_offloads(app.state.api)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            yield Served(app, http)
    # Without CPU processes a body over OFFLOAD_BYTES is decoded on the API's thread: a test
    # sending one would pass without the path a served API takes for it.
    assert not offloaded or config.api.cpu_processes, (
        f"the test sent {len(offloaded)} append bodies over OFFLOAD_BYTES to an API without "
        "CPU processes: give it some (api_config(cpu_processes=1), or mark the test "
        "@pytest.mark.cpu_processes(1))")


def _count_offloads(api: Api) -> list[int]:
    """The sizes of the bodies ``api`` decodes off the event loop, from now on."""
    sizes: list[int] = []
    offload = api.offload

    async def counted(raw: bytes, content_type: str | None,
                      run_model: str | None) -> PreparedAppend:
        sizes.append(len(raw))
        return await offload(raw, content_type, run_model)

    api.offload = counted  # type: ignore[method-assign]
    return sizes
