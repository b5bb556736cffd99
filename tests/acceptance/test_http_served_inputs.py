"""``compactd serve`` as a real process on PostgreSQL: creating one session from many connections
at once, and session ids that uvicorn decodes to the same text."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.api import TOKEN_A, TOKEN_B, bearer, start_api

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
