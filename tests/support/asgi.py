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
from fastapi import FastAPI

from compactd.scheduler.http import API_PREFIX, create_app, token_sha256
from compactd.worker.settings import Config, Settings, build_config

TOKEN_A = "token-for-tenant-a-0123456789"
TOKEN_B = "token-for-tenant-b-9876543210"
A = {"Authorization": f"Bearer {TOKEN_A}"}
B = {"Authorization": f"Bearer {TOKEN_B}"}
MAX_BODY = 64 * 1024
# The /v1 routes that name no session (they serve no tenant's data, but still take a token).
SESSIONLESS = {API_PREFIX + "/tools"}


def api_config(database_url: str, home: Path, **raw: Any) -> Config:
    broker_url = raw.pop("broker_url", None)
    raw.setdefault("api", {})
    raw["api"] = {"tokens": [{"tenant": "tenant-a", "token_sha256": token_sha256(TOKEN_A)},
                             {"tenant": "tenant-b", "token_sha256": token_sha256(TOKEN_B)}],
                  "max_body_bytes": MAX_BODY, "max_wait_s": 0.5, **raw["api"]}
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


async def serve_app(config: Config) -> AsyncIterator[Served]:
    app = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            yield Served(app, http)
