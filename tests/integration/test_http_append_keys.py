"""``POST /v1/sessions/{id}/messages`` with an ``Idempotency-Key`` header, through the ASGI app
(lifespan included) on real SQLite and PostgreSQL: a request sent again after its answer was
lost answers with the first one's body and stores nothing; the key with another body is 409
naming it; a header that cannot be a key is 422 naming the header, and nothing is stored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.asgi import A, Served, api_config, serve_app

STEP = {"messages": [{"role": "user", "content": "Why does tests/test_tax.py fail?"}]}
URL = "/v1/sessions/s/messages"


@pytest.fixture
async def api(db_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    async for served in serve_app(api_config(db_url, tmp_path)):
        await served.create("s", A)
        yield served


async def _contents(api: Served) -> list[str]:
    surface = (await api.http.get("/v1/sessions/s/surface", headers=A)).json()
    return [m["content"] for m in surface["messages"]]


async def test_a_request_sent_again_with_its_key_answers_the_first_and_stores_nothing(
        api: Served) -> None:
    headers = {**A, "Idempotency-Key": "0f8e2d7c-step-1"}
    first = await api.http.post(URL, headers=headers, json=STEP)
    # The runtime never got that answer (a timeout, a dropped connection) and sends it again.
    again = await api.http.post(URL, headers=headers, json=STEP)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["replayed"] is False and again.json()["replayed"] is True
    assert {**again.json(), "replayed": False} == first.json()
    assert await _contents(api) == [STEP["messages"][0]["content"]]
    status = (await api.http.get("/v1/sessions/s", headers=A)).json()
    assert status["version"] == first.json()["version"]


async def test_without_the_header_the_same_request_twice_stores_it_twice(api: Served) -> None:
    for _ in range(2):
        assert (await api.http.post(URL, headers=A, json=STEP)).status_code == 200
    assert len(await _contents(api)) == 2


async def test_the_key_with_another_body_is_409_naming_it(api: Served) -> None:
    headers = {**A, "Idempotency-Key": "step-1"}
    assert (await api.http.post(URL, headers=headers, json=STEP)).status_code == 200
    other = await api.http.post(URL, headers=headers, json={
        "messages": [{"role": "user", "content": "another question"}]})
    assert other.status_code == 409, other.text
    assert other.json()["error"] == "conflict" and "'step-1'" in other.json()["message"]
    assert await _contents(api) == [STEP["messages"][0]["content"]]


# A header's value and what the 422 says of it (one app per backend serves them all: starting
# the app is most of each test's time).
ODD_KEYS = [
    (b"", "must not be empty"),
    (b"k" * 1000, "at most 255 characters, not 1000"),
    ("clé".encode(), "printable ASCII without blanks"),
    (b"two words", "printable ASCII without blanks (U+0020 at character 3)"),
]


async def test_a_header_that_cannot_be_a_key_is_422_naming_it_and_nothing_is_stored(
        api: Served) -> None:
    for value, problem in ODD_KEYS:
        response = await api.http.post(URL, headers=[*A.items(), ("Idempotency-Key", value)],
                                       json=STEP)
        assert response.status_code == 422, (value, response.text)
        body = response.json()
        assert body["field"] == "header.Idempotency-Key", (value, body)
        assert problem in body["message"], (value, body)
    assert await _contents(api) == []


async def test_the_openapi_document_describes_the_header_and_the_409(api: Served) -> None:
    operation = (await api.http.get("/openapi.json")).json()["paths"][
        "/v1/sessions/{session_id}/messages"]["post"]
    assert {p["name"] for p in operation["parameters"] if p["in"] == "header"} >= {
        "Idempotency-Key"}
    assert "409" in operation["responses"]
