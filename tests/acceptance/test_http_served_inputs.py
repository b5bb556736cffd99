"""``compactd serve`` as a real process on PostgreSQL: creating one session from many connections
at once, session ids that uvicorn decodes to the same text, and requests too long to read."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.parse
from typing import Any

import httpx
import pytest

from compactd.scheduler.http.middleware import MAX_REQUEST_HEAD_BYTES
from compactd.storage.recall_bounds import MAX_QUERY_BYTES
from compactd.storage.store import Store
from tests.support.api import TOKEN_A, TOKEN_B, bearer, start_api
from tests.support.tables import row_counts

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

RACERS = 16


async def _put_all(url: str, requests: list[tuple[str, dict[str, object]]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await asyncio.gather(*[
            http.put("/v1/sessions/race", headers=bearer(token), json=body)
            for token, body in requests])


def test_concurrent_puts_of_one_new_session_through_the_server(make_stack) -> None:  # type: ignore[no-untyped-def]
    url = start_api(make_stack())
    same = asyncio.run(_put_all(url, [(TOKEN_A, {"run_model": "gpt-4o"})] * RACERS))
    assert sorted(r.status_code for r in same) == [200] * (RACERS - 1) + [201], \
        [r.text for r in same]

    mixed = asyncio.run(_put_all(url, [(TOKEN_A, {"run_model": "gpt-4o"}),
                                       (TOKEN_A, {"run_model": "claude-x"}),
                                       (TOKEN_B, {"run_model": "gpt-4o"})] * (RACERS // 2)))
    for response in mixed:
        body = response.json()
        assert response.status_code in (200, 404, 409), response.text
        assert "unique" not in response.text.lower() and "duplicate" not in response.text
        if response.status_code == 409:
            assert "run_model" in body["message"] and "claude-x" in body["message"]
    status = httpx.get(f"{url}/v1/sessions/race", headers=bearer(TOKEN_A), timeout=30).json()
    assert status["tenant"] == "tenant-a" and status["run_model"] == "gpt-4o"


def test_ids_uvicorn_would_decode_to_one_text_are_refused(make_stack) -> None:  # type: ignore[no-untyped-def]
    url = start_api(make_stack())
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=30) as http:
        for raw in ("x%FFy", "x%FEy", "x%00y", "x%C2%85y"):
            response = http.put(f"/v1/sessions/{raw}", json={})
            assert response.status_code == 422, (raw, response.text)
            assert response.json()["field"] == "path.session_id"
        assert http.put("/v1/sessions/x%C3%BFy", json={}).status_code == 201  # "xÿy" is fine
        assert http.get("/v1/sessions/x%FFy").status_code == 422


def _raw_get(url: str, target: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """One GET over a plain socket (http.client sends the whole request line before it reads
    the answer, as any client does): the status and the JSON body."""
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        connection.request("GET", target, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _rows(database_url: str) -> dict[str, int]:
    async def count() -> dict[str, int]:
        store = Store.from_url(database_url)
        try:
            return await row_counts(store)
        finally:
            await store.close()

    return asyncio.run(count())


def test_a_recall_query_of_any_length_gets_an_answer_naming_its_limit(make_stack) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack()
    url = start_api(stack)
    assert httpx.put(f"{url}/v1/sessions/s1", headers=bearer(TOKEN_A), json={},
                     timeout=30).status_code == 201
    before = _rows(stack.database_url)
    search = "/v1/sessions/s1/history/search?query="
    # The longest legal query, each byte percent-encoded: larger than h11's own head limit.
    longest = urllib.parse.quote("€" * (MAX_QUERY_BYTES // 3))
    status, body = _raw_get(url, search + longest, bearer(TOKEN_A))
    assert status == 200, body
    # Over the query's bound: 422 naming it, while the URL fits the server's head limit.
    status, body = _raw_get(url, search + "a" * 40_000,
                            bearer(TOKEN_A))
    assert status == 422 and f"at most {MAX_QUERY_BYTES} bytes" in body["message"], body
    # Over the head limit (the connection was reset before: no answer at all).
    for size in (1_000_000, 4_000_000):
        status, body = _raw_get(url, search + "a" * size, bearer(TOKEN_A))
        assert status == 414, (size, status, body)
        assert body["error"] == "too_large" and str(MAX_REQUEST_HEAD_BYTES) in body["message"]
    status, body = _raw_get(url, search + "x", {**bearer(TOKEN_A), "X-Pad": "p" * 200_000})
    assert status == 431 and str(MAX_REQUEST_HEAD_BYTES) in body["message"], body
    # The server goes on serving, and nothing stored changed.
    assert httpx.get(f"{url}{search}x", headers=bearer(TOKEN_A), timeout=30).status_code == 200
    assert _rows(stack.database_url) == before
