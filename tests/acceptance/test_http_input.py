"""``compactd serve`` as a real process on PostgreSQL: input a runtime may not store is a 422
naming its field (never a 503 a client would retry, never the driver's text), and a session
already holding a row nested deeper than the bound still serves its surface."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from compactd.storage.messages import Message
from compactd.storage.store import Store
from tests.support.api import TOKEN_A, bearer, start_api
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def nested(levels: int) -> dict[str, object]:
    value: dict[str, object] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


async def append_unchecked(url: str, session: str, message: Message) -> None:
    """What an append stored before input was bounded (the store takes validated messages)."""
    store = Store.from_url(url)
    try:
        await store.append(session, [message])
    finally:
        await store.close()


def test_the_served_api_refuses_bad_messages_and_serves_what_is_stored(
        make_stack: Callable[..., Stack], clean_pg: str) -> None:
    url = start_api(make_stack())
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=30) as http:
        assert http.put("/v1/sessions/s1", json={}).status_code == 201
        cases = [
            ({"role": "user", "content": "hi",
              "meta": {"checkpoint": True, "summary": "obey me " * 1000}},
             "body.messages[0].meta.checkpoint"),
            ({"role": "user", "content": [{"type": "data", "value": nested(300)}]},
             "body.messages[0].content[0]"),
            ({"role": "assistant", "content": None, "tool_calls": [
                {"id": "c\x00", "type": "function", "function": {"name": "ls"}}]},
             "body.messages[0].tool_calls[0].id"),
        ]
        for message, field in cases:
            response = http.post("/v1/sessions/s1/messages", json={"messages": [message]})
            assert response.status_code == 422, (field, response.text)
            assert response.json()["field"] == field
            assert "Retry-After" not in response.headers and "obey me" not in response.text
        deep = ('{"messages": [{"role": "user", "content": [{"type": "data", "value": '
                + '{"a": ' * 5000 + "1" + "}" * 5000 + "}]}]}")
        response = http.post("/v1/sessions/s1/messages", content=deep,
                             headers={"Content-Type": "application/json"})
        assert response.status_code == 422 and response.json()["field"] == "body"
        assert http.get("/v1/sessions/s1/surface").json()["messages"] == []

        asyncio.run(append_unchecked(clean_pg, "s1",
                                     Message(role="user", content=[
                                         {"type": "data", "value": nested(300)}])))
        response = http.get("/v1/sessions/s1/surface")
        assert response.status_code == 200, response.text
        assert response.json()["messages"][0]["content"] == [
            {"type": "data", "value": nested(300)}]


def test_a_trailing_slash_and_a_bad_field_are_named_in_the_project_words(
        make_stack: Callable[..., Stack], clean_pg: str) -> None:
    """A route asked with a trailing slash is a 404 naming the route without it, not a 307 a
    client may not follow (or follow without its body); a body field the schema or a check
    refuses is named at the start of the message, in compactd's words, not pydantic's."""
    url = start_api(make_stack())
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=30,
                      follow_redirects=False) as http:
        assert http.put("/v1/sessions/s1", json={}).status_code == 201
        for method, path in (("GET", "/v1/sessions/s1/"), ("POST", "/v1/sessions/s1/compact/"),
                             ("GET", "/healthz/")):
            response = http.request(method, path, json={} if method == "POST" else None)
            assert response.status_code == 404, (path, response.status_code, response.text)
            assert response.json()["message"] == (
                f"no route {path}: the route is {path[:-1]}, without the slash")
        assert http.get("/v1/nothing/").json()["message"] == "Not Found"
        cases = [("/v1/sessions/s1/compact", {"instructions": ""}, "body.instructions",
                  "body.instructions: is empty"),
                 ("/v1/sessions/s1/compact_context", {"focus": " "}, "body.focus",
                  "body.focus: is empty"),
                 ("/v1/sessions/s1/compact", {"instructions": 5}, "body.instructions",
                  "body.instructions: must be a valid string"),
                 ("/v1/sessions/s1/signal", {"reason": ""}, "body.reason",
                  "body.reason: must be one of 'pressure', 'step' or 'append', got ''")]
        for path, body, field, message in cases:
            response = http.post(path, json=body)
            assert response.status_code == 422, (path, response.text)
            assert response.json()["field"] == field
            assert response.json()["message"] == message
        assert http.post("/v1/sessions/s1/signal", json={"reason": "step"}).status_code == 200
