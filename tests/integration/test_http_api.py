"""The HTTP API in process (ASGI, lifespan included) on real SQLite and PostgreSQL.

Tenancy, ETag polling, the body limit, validation errors naming their field, and the mapping of
compactd's exceptions to statuses. The served API under load and under schemathesis lives in
``tests/acceptance``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from compactd.scheduler.http import API_PREFIX, create_app
from compactd.storage.errors import ConfigError
from compactd.storage.kinds import NodeKind
from compactd.storage.records import Claim, Replacement, RunEnd
from compactd.storage.store import Store
from compactd.worker.settings import Settings, build_config
from tests.support.asgi import (
    MAX_BODY,
    SESSIONLESS,
    TOKEN_A,
    A,
    B,
    Served,
    api_config,
    marked_cpu_processes,
    serve_app,
)


@pytest.fixture
async def api(db_url: str, tmp_path: Path, request: pytest.FixtureRequest
              ) -> AsyncIterator[Served]:
    config = api_config(db_url, tmp_path, cpu_processes=marked_cpu_processes(request))
    async for served in serve_app(config):
        yield served


def session_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route that names a session: what tenancy must cover."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path.startswith(API_PREFIX) \
                and route.path not in SESSIONLESS:
            assert "{session_id}" in route.path, f"{route.path}: a /v1 route without a session"
            out.extend((method, route.path) for method in sorted(route.methods))
    return out


# ------------------------------------------------------------------------------------------
# tenancy


async def test_a_token_gets_404_for_every_session_of_another_tenant_on_every_route(
        api: Served) -> None:
    await api.create("b-session", B, run_model="gpt-4o")
    assert (await api.append("b-session", B, {"role": "user", "content": "B's secret"})
            ).status_code == 200
    await api.create("a-session", A)
    before = (await api.http.get("/v1/sessions/b-session", headers=B)).json()

    routes = session_routes(api.app)
    assert len(routes) >= 8, routes
    bodies: list[Any] = [None, {}, {"bogus": 1}, {"messages": [{"role": "user", "content": "x"}]},
                         {"input_tokens": 10}, {"wait": True}]
    for method, path in routes:
        for body in bodies:
            kwargs = {} if body is None else {"json": body}
            foreign = await api.http.request(
                method, path.format(session_id="b-session"), headers=A, **kwargs)
            assert foreign.status_code == 404, (method, path, body, foreign.text)
            assert foreign.json()["error"] == "not_found"
            assert "B's secret" not in foreign.text and "tenant-b" not in foreign.text
            if method == "PUT":
                continue  # creating a missing session is what PUT is for
            missing = await api.http.request(
                method, path.format(session_id="no-such-session"), headers=A, **kwargs)
            # Indistinguishable from a session that does not exist (but for the id it echoes).
            assert missing.status_code == 404, (method, path, body, missing.text)
            assert foreign.json()["message"].replace("b-session", "X") == \
                missing.json()["message"].replace("no-such-session", "X")
        # The same route serves its owner: the 404 above is the tenant check, not the route.
        own = await api.http.request(method, path.format(session_id="a-session"), headers=A,
                                     json={})
        assert own.status_code != 404, (method, path, own.text)
        if method == "DELETE":
            await api.create("a-session", A)  # its owner's delete took it

    after = (await api.http.get("/v1/sessions/b-session", headers=B)).json()
    assert after == before, "tenant A's requests changed tenant B's session"


async def test_every_session_route_refuses_a_missing_or_unknown_token(api: Served) -> None:
    await api.create("a-session", A)
    for method, path in session_routes(api.app):
        url = path.format(session_id="a-session")
        for headers in ({}, {"Authorization": "Bearer not-a-token"},
                        {"Authorization": f"Basic {TOKEN_A}"}):
            response = await api.http.request(method, url, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.json()["error"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"


async def test_creating_an_id_another_tenant_holds_answers_404_and_changes_nothing(
        api: Served) -> None:
    await api.create("taken", B, run_model="gpt-4o", envelope={"system": "B's prompt"})
    response = await api.http.put("/v1/sessions/taken", headers=A,
                                  json={"envelope": {"system": "A's prompt"}})
    assert response.status_code == 404
    status = (await api.http.get("/v1/sessions/taken", headers=B)).json()
    assert status["tenant"] == "tenant-b" and status["envelope_tokens"] > 0


async def test_tokens_are_never_logged(api: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    await api.create("s1", A)
    await api.http.get("/v1/sessions/s1", headers={"Authorization": "Bearer wrong-token-xyz"})
    await api.http.get("/v1/sessions/s1", headers=A)
    logged = "\n".join(r.getMessage() + repr(vars(r)) for r in caplog.records)
    assert TOKEN_A not in logged and "wrong-token-xyz" not in logged


# ------------------------------------------------------------------------------------------
# sessions, the surface and its ETag


async def test_create_is_201_then_200_and_409_for_another_run_model(api: Served) -> None:
    first = await api.http.put("/v1/sessions/s1", headers=A, json={
        "run_model": "gpt-4o", "envelope": {"system": "You are terse.",
                                            "tools": [{"type": "function",
                                                       "function": {"name": "read"}}]}})
    assert first.status_code == 201 and first.json()["created"] is True
    assert first.json()["envelope_tokens"] > 0 and first.json()["tenant"] == "tenant-a"
    again = await api.http.put("/v1/sessions/s1", headers=A, json={})
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["run_model"] == "gpt-4o"
    other = await api.http.put("/v1/sessions/s1", headers=A, json={"run_model": "claude-x"})
    assert other.status_code == 409 and other.json()["error"] == "conflict"


async def test_surface_etag_is_the_version_and_an_unchanged_surface_is_304(api: Served) -> None:
    await api.create("s1", A)
    step = (await api.append("s1", A, {"role": "user", "content": "hello"})).json()
    first = await api.http.get("/v1/sessions/s1/surface", headers=A)
    assert first.status_code == 200
    assert first.headers["etag"] == f'"{step["version"]}"' == f'"{first.json()["version"]}"'
    assert [m["content"] for m in first.json()["messages"]] == ["hello"]
    assert set(first.json()["messages"][0]) == {"seq", "role", "content", "tokens"}

    for tag in (first.headers["etag"], f'W/{first.headers["etag"]}',
                f'"999", {first.headers["etag"]}', "*"):
        unchanged = await api.http.get("/v1/sessions/s1/surface",
                                       headers={**A, "If-None-Match": tag})
        assert unchanged.status_code == 304, tag
        assert unchanged.headers["etag"] == first.headers["etag"] and unchanged.content == b""

    await api.append("s1", A, {"role": "assistant", "content": "hi"})
    moved = await api.http.get("/v1/sessions/s1/surface",
                               headers={**A, "If-None-Match": first.headers["etag"]})
    assert moved.status_code == 200 and moved.headers["etag"] != first.headers["etag"]
    assert [m["role"] for m in moved.json()["messages"]] == ["user", "assistant"]


async def test_a_long_poll_of_the_surface_returns_with_a_commit(api: Served,
                                                                   db_url: str) -> None:
    await api.create("s1", A)
    for n in range(4):
        await api.append("s1", A, {"role": "user", "content": f"m{n}"})
    first = await api.http.get("/v1/sessions/s1/surface", headers=A)
    tag = first.headers["etag"]
    # Nothing commits: 304 once the wait is over.
    idle = await api.http.get("/v1/sessions/s1/surface", params={"wait": 0.3},
                              headers={**A, "If-None-Match": tag})
    assert idle.status_code == 304
    too_long = await api.http.get("/v1/sessions/s1/surface", params={"wait": 61},
                                  headers={**A, "If-None-Match": tag})
    assert too_long.status_code == 422 and "wait" in too_long.text

    committer = Store.from_url(db_url)
    try:
        waiting = asyncio.create_task(api.http.get(
            "/v1/sessions/s1/surface", params={"wait": 30}, headers={**A, "If-None-Match": tag}))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        claim = await committer.claim("s1", owner="w1", trigger="manual", lease_s=30)
        assert isinstance(claim, Claim)
        await committer.commit("s1", run_id=claim.run_id, fence=claim.fence, replacements=[
            Replacement(seqs=(1, 2), kind=NodeKind.CHECKPOINT, tokens=3,
                        payload={"role": "user", "content": "summary",
                                 "meta": {"checkpoint": True, "summary": "summary"}},
                        journal_kind="compaction/summary", journal={"text": "summary"})],
            end=RunEnd(outcome="committed"))
        moved = await asyncio.wait_for(waiting, 10)
    finally:
        await committer.close()
    assert moved.status_code == 200 and moved.headers["etag"] != tag
    assert len(moved.json()["messages"]) == 3


async def test_usage_signal_and_status(api: Served) -> None:
    await api.create("s1", A)
    await api.append("s1", A, {"role": "user", "content": "hello"})
    usage = await api.http.post("/v1/sessions/s1/usage", headers=A, json={"input_tokens": 1234})
    assert usage.status_code == 200 and usage.json()["reported_input_tokens"] == 1234
    signal = await api.http.post("/v1/sessions/s1/signal", headers=A)
    assert signal.status_code == 200 and signal.json()["enqueued"] is False
    assert signal.json()["reason"].startswith("not compacting")
    status = (await api.http.get("/v1/sessions/s1", headers=A)).json()
    assert status["messages"] == 1 and status["runs"] == []
    # The lead the session fires by and why: auto (the default), and no run measured yet:
    # the first lead (0 by default).
    assert status["lead"] == {
        "seconds": 0.0, "source": "first", "runs": None, "p90_s": None,
        "why": "auto, no run measured yet: the first lead, summarization.first_lead_s 0 s",
        "tokens": 0, "growth_tokens": 0, "step_tokens": 0, "by": None}


@pytest.mark.cpu_processes(1)
async def test_compact_and_overflow_without_a_worker_answer_202_within_the_wait_cap(
        api: Served) -> None:
    await api.create("s1", A)
    await api.append("s1", A, *[{"role": "user" if i % 2 == 0 else "assistant",
                                 "content": f"message {i} " + "words " * 200} for i in range(30)])
    queued = await api.http.post("/v1/sessions/s1/compact", headers=A, json={})
    assert queued.status_code == 202 and queued.json()["outcome"] == "queued"
    # No worker runs here: waiting ends at api.max_wait_s (0.5 s), not at the asked 3600 s.
    waited = await api.http.post("/v1/sessions/s1/compact", headers=A,
                                 json={"wait": True, "timeout_s": 3600, "force": True})
    assert waited.status_code == 202 and "not finished within 0.5 s" in waited.json()["reason"]
    overflow = await api.http.post("/v1/sessions/s1/overflow", headers=A, json={"wait": True})
    assert overflow.status_code == 202 and overflow.json()["compacted"] is False


# ------------------------------------------------------------------------------------------
# limits and errors


async def test_a_body_over_the_limit_is_413_whether_it_has_a_length_or_is_chunked(
        api: Served) -> None:
    await api.create("s1", A)
    big = {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}
    sized = await api.http.post("/v1/sessions/s1/messages", headers=A, json=big)
    assert sized.status_code == 413
    assert sized.json()["error"] == "too_large" and "api.max_body_bytes" in sized.json()["message"]

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}]}'

    chunked = await api.http.post("/v1/sessions/s1/messages", content=chunks(),
                                  headers={**A, "content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"] == "too_large"
    surface = (await api.http.get("/v1/sessions/s1/surface", headers=A)).json()
    assert surface["messages"] == [], "a refused body appended something"


@pytest.mark.parametrize(("method", "path", "body", "field", "index"), [
    ("POST", "messages", {}, "body.messages", None),
    ("POST", "messages", {"messages": []}, "body.messages", None),
    ("POST", "messages", {"messages": [{"role": "user", "content": "ok"},
                                       {"role": "tool", "content": "r", "tool_call_id": "c9"}]},
     "body.messages[1].tool_call_id", 1),
    ("POST", "messages", {"messages": [{"role": "wizard", "content": "x"}]},
     "body.messages[0].role", 0),
    ("POST", "messages", {"messages": [{"role": "user"}], "format": "yaml"}, "body.format",
     None),
    ("POST", "usage", {"input_tokens": -1}, "body.input_tokens", None),
    ("POST", "compact", {"keep": "lots"}, "body.keep", None),
    ("POST", "compact", {"timeout_s": 0}, "body.timeout_s", None),
    ("GET", "surface?render=html", None, "query.render", None),
    ("PUT", "", {"policy": {"trigger": "soon"}}, "body.policy.trigger", None),
    ("PUT", "", {"context_window": 0}, "body.context_window", None),
    ("PUT", "", {"surprise": 1}, "body.surprise", None),
])
async def test_validation_errors_are_422_and_name_the_field(
        api: Served, method: str, path: str, body: Any, field: str, index: int | None) -> None:
    await api.create("s1", A)
    url = "/v1/sessions/s1" + (f"/{path}" if path else "")
    kwargs = {} if body is None else {"json": body}
    response = await api.http.request(method, url, headers=A, **kwargs)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid"
    assert response.json()["field"] == field and response.json()["index"] == index


async def test_a_body_that_is_not_json_is_422_naming_the_body(api: Served) -> None:
    await api.create("s1", A)
    response = await api.http.post("/v1/sessions/s1/messages", content=b'{"messages": [',
                                   headers={**A, "content-type": "application/json"})
    assert response.status_code == 422 and response.json()["field"] == "body"
    assert "not valid JSON" in response.json()["message"]


@pytest.mark.parametrize("session", ["nul%00id", "tab%09id", "x" * 256])
async def test_a_session_id_postgres_cannot_store_is_422_not_503(
        api: Served, session: str) -> None:
    response = await api.http.put(f"/v1/sessions/{session}", headers=A, json={})
    assert response.status_code == 422 and response.json()["field"] == "path.session_id"


async def test_an_append_whose_signal_cannot_be_enqueued_still_succeeds_once(
        db_url: str, tmp_path: Path) -> None:
    # The broker is a closed port; the trigger fires on the first append.
    config = api_config(db_url, tmp_path, broker_url="redis://127.0.0.1:1/0",
                        summarization={"trigger": [{"type": "messages", "value": 1}],
                                       "keep": {"type": "tokens", "value": 100}})
    async for served in serve_app(config):
        await served.create("s1", A)
        step = await served.append("s1", A, {"role": "user", "content": "a"},
                                   {"role": "assistant", "content": "b"})
        assert step.status_code == 200, step.text
        # The append answers before its signal's send ends; the send fails and frees the mark.
        assert step.json()["fired"] is True and step.json()["signalled"] is True
        assert step.json()["last_seq"] == 2
        await served.app.state.api.client.drain()
        signal = await served.http.post("/v1/sessions/s1/signal", headers=A)
        assert signal.status_code == 503 and signal.headers["retry-after"] == "1"
        assert signal.json()["error"] == "unavailable"
    store = Store.from_url(db_url)
    try:
        assert (await store.verify("s1")).ok
        assert (await store.get_session("s1")).last_seq == 2
    finally:
        await store.close()


async def test_a_database_that_cannot_be_reached_is_503(tmp_path: Path) -> None:
    config = api_config("postgresql://postgres@127.0.0.1:1/compactd", tmp_path)
    async for served in serve_app(config):
        response = await served.http.get("/v1/sessions/s1", headers=A)
        assert response.status_code == 503 and response.json()["error"] == "unavailable"
        assert response.headers["retry-after"] == "1"
        health = await served.http.get("/healthz")
        assert health.status_code == 503


# ------------------------------------------------------------------------------------------
# configuration


def test_tokens_come_from_the_environment_or_a_digest_and_one_is_required(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/x.sqlite3"
    with pytest.raises(ConfigError, match=r"^api\.tokens: no bearer token"):
        create_app(build_config({}, settings=Settings(database_url=url), home=tmp_path))
    config = build_config({"api": {"tokens": [{"tenant": "t", "token_env": "MY_TOKEN"}]}},
                          settings=Settings(database_url=url), home=tmp_path)
    with pytest.raises(ConfigError, match=r"^api\.tokens\[0\]\.token_env: .*MY_TOKEN"):
        create_app(config, environ={})
    app = create_app(config, environ={"MY_TOKEN": "s3cret"})
    assert app.state.tokens.tenant("s3cret") == "t"
    assert app.state.tokens.tenant("s3cret ") is None and app.state.tokens.tenant("") is None
    with pytest.raises(ConfigError, match=r"api\.tokens\[0\]: .*exactly one"):
        build_config({"api": {"tokens": [{"tenant": "t", "token_env": "X",
                                          "token_sha256": "0" * 64}]}}, home=tmp_path)
    with pytest.raises(ConfigError, match=r"api\.tokens\[0\]\.token_sha256"):
        build_config({"api": {"tokens": [{"tenant": "t", "token_sha256": "abc"}]}},
                     home=tmp_path)


def test_the_openapi_document_describes_every_status_of_every_route(tmp_path: Path) -> None:
    app = create_app(api_config(f"sqlite:///{tmp_path}/x.sqlite3", tmp_path))
    doc = app.openapi()
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            if path in SESSIONLESS:
                assert {"200", "401"} <= codes, (method, path)
            elif path.startswith(API_PREFIX):
                # A route that only ever queues (compact_context) succeeds with 202.
                assert {"200", "202"} & codes, (method, path)
                assert {"401", "404", "422", "503"} <= codes, (method, path)
            if path.startswith(API_PREFIX):
                assert operation["security"] == [{"HTTPBearer": []}]
                if "requestBody" in operation:
                    assert {"400", "413"} <= codes, (method, path)
            for code, response in operation["responses"].items():
                if code != "304":
                    assert "application/json" in response["content"], (method, path, code)
    assert re.search(r"ETag", str(doc["paths"]["/v1/sessions/{session_id}/surface"]))


def test_serve_refuses_to_start_without_a_token(cli_env: dict[str, str], tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "compactd.scheduler.cli", "serve", "--port", "0"],
                         env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "api.tokens: no bearer token is configured" in out.stderr


# ------------------------------------------------------------------------------------------
# large bodies: decoded and counted off the event loop


@pytest.mark.cpu_processes(1)
async def test_a_large_append_is_decoded_and_counted_off_the_loop_with_the_same_result(
        api: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import compactd.scheduler.http.bodies
    from compactd.scheduler.client import parse_messages
    from compactd.scheduler.http.state import OFFLOAD_BYTES
    from compactd.storage.store import prepare_append

    threads: list[str] = []

    def spied(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return parse_messages(*args, **kwargs)

    # Seen only in the server's own process: PostgreSQL batches are parsed and prepared in a
    # CPU process (which imports the module afresh).
    monkeypatch.setattr(compactd.scheduler.http.bodies, "parse_messages", spied)
    await api.create("big", A, run_model="gpt-4o")
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "cat", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "log line é\n" * 2000},
        *({"role": "user", "content": f"m{i}"} for i in range(500))]
    body = {"messages": messages}
    assert OFFLOAD_BYTES < len(json.dumps(body)) < MAX_BODY
    step = await api.append("big", A, *messages)
    assert step.status_code == 200, step.text
    small = await api.append("big", A, {"role": "user", "content": "after"})
    assert small.status_code == 200, small.text
    if not api.app.state.api.store.db.encodes_appends:
        assert threads == ["compactd-api-cpu_0", "MainThread"], threads
    else:
        assert threads == ["MainThread"], threads

    counted = prepare_append(parse_messages(messages), "gpt-4o").tokens
    surface = (await api.http.get("/v1/sessions/big/surface", headers=A)).json()
    assert [m["tokens"] for m in surface["messages"][:-1]] == list(counted)
    assert step.json()["tokens"] == sum(counted) and step.json()["messages"] == len(messages)
    assert [m.get("content") for m in surface["messages"][1:3]] == [messages[1]["content"],
                                                                    "m0"]


@pytest.mark.cpu_processes(1)
@pytest.mark.parametrize(("bad", "field"), [
    ({"role": "wizard", "content": "x"}, "body.messages[400].role"),
    ({"role": "tool", "tool_call_id": "nobody", "content": "x"},
     "body.messages[400].tool_call_id"),
    ({"role": "user", "content": 5}, "body.messages[400].content"),
])
async def test_a_large_append_with_one_bad_message_is_422_naming_it_and_writes_nothing(
        api: Served, bad: dict[str, Any], field: str) -> None:
    from compactd.scheduler.http.state import OFFLOAD_BYTES

    await api.create("big", A)
    messages = [{"role": "user", "content": "filler " * 12} for _ in range(400)] + [bad]
    assert len(json.dumps({"messages": messages})) > OFFLOAD_BYTES
    response = await api.append("big", A, *messages)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field and response.json()["index"] == 400
    status = (await api.http.get("/v1/sessions/big", headers=A)).json()
    assert status["messages"] == 0 and status["version"] == 0


@pytest.mark.cpu_processes(1)
async def test_a_body_that_is_not_json_is_422_or_400_as_fastapi_answers_it(api: Served) -> None:
    from compactd.scheduler.http.state import OFFLOAD_BYTES

    await api.create("s1", A)
    raw = b'{"messages": [' + b'{"role": "user", "content": "x"},' * 1200
    assert len(raw) > OFFLOAD_BYTES
    response = await api.http.post("/v1/sessions/s1/messages", content=raw,
                                   headers={**A, "content-type": "application/json"})
    assert response.status_code == 422 and response.json()["field"] == "body"
    assert "not valid JSON" in response.json()["message"]
    plain = await api.http.post("/v1/sessions/s1/messages", content=b"hello",
                                headers={**A, "content-type": "text/plain"})
    assert plain.status_code == 422 and plain.json()["field"] == "body", plain.text
    empty = await api.http.post("/v1/sessions/s1/messages", headers=A)
    assert empty.status_code == 422 and empty.json()["field"] == "body", empty.text
    not_utf8 = await api.http.post("/v1/sessions/s1/messages", content=b"dD\xff h\x04",
                                   headers={**A, "content-type": "application/json"})
    assert not_utf8.status_code == 400, not_utf8.text
    assert not_utf8.json()["error"] == "bad_request"
    # Nested past the parser's limit: refused as input nested too deep, whichever path read it.
    too_deep = await api.http.post("/v1/sessions/s1/messages", content=b"[" * 50_000,
                                   headers={**A, "content-type": "application/json"})
    assert too_deep.status_code == 422 and too_deep.json()["field"] == "body", too_deep.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          None])
async def test_json_sent_without_a_json_content_type_is_told_which_header_to_send(
        api: Served, content_type: str | None) -> None:
    # curl -d sends a form type unless told: the answer names the header, not pydantic's
    # "valid dictionary" (the same text as a JSON array, which is another mistake).
    await api.create("s1", A)
    headers = {**A, **({"content-type": content_type} if content_type else {})}
    for method, path, body in (
            ("POST", "/v1/sessions/s1/messages", {"messages": [{"role": "user", "content": "x"}]}),
            ("PUT", "/v1/sessions/s2", {"run_model": "gpt-4o"}),
            ("POST", "/v1/sessions/s1/usage", {"input_tokens": 10})):
        response = await api.http.request(method, path, content=json.dumps(body).encode(),
                                          headers=headers)
        assert response.status_code == 422, (path, response.text)
        error = response.json()
        assert error["field"] == "body", error
        assert "Content-Type: application/json" in error["message"], error
        assert (content_type or "none") in error["message"], error
    array = await api.http.post("/v1/sessions/s1/messages", json=[], headers=A)
    assert array.status_code == 422 and "Content-Type" not in array.json()["message"]
    assert (await api.http.get("/v1/sessions/s2", headers=A)).status_code == 404


async def test_a_session_id_with_a_slash_is_reached_percent_encoded_on_every_route(
        api: Served) -> None:
    # The CLI and the client take "/" in an id (run/42, a LangGraph namespace); a runtime on
    # HTTP encodes it as %2F, which must name that session, not route to another.
    await api.create("x", A)
    assert (await api.append("x", A, {"role": "user", "content": "x's own"})).status_code == 200
    created = await api.http.put("/v1/sessions/x%2Fsurface", headers=A, json={})
    assert created.status_code == 201 and created.json()["session"] == "x/surface", created.text
    appended = await api.http.post("/v1/sessions/x%2Fsurface/messages", headers=A,
                                   json={"messages": [{"role": "user", "content": "slashed"}]})
    assert appended.status_code == 200, appended.text
    info = await api.http.get("/v1/sessions/x%2Fsurface", headers=A)
    assert info.status_code == 200 and info.json()["session"] == "x/surface", info.text
    surface = await api.http.get("/v1/sessions/x%2Fsurface/surface", headers=A)
    assert [m["content"] for m in surface.json()["messages"]] == ["slashed"], surface.text
    for path in ("/v1/sessions/run%2F42%2Fa%25b", "/v1/sessions/run%2f42%2fa%25b"):
        response = await api.http.put(path, headers=A, json={})
        assert response.json()["session"] == "run/42/a%b", response.text
    missing = await api.http.get("/v1/sessions/no%2Fsuch/surface", headers=A)
    assert missing.status_code == 404 and "'no/such'" in missing.json()["message"]
    # What the id rule refuses is still refused, a slash beside it or not.
    for path in ("/v1/sessions/a%00%2Fb", "/v1/sessions/a%2F%00"):
        refused = await api.http.get(path, headers=A)
        assert refused.status_code == 422 and "control characters" in refused.text, refused.text


async def test_the_interactive_docs_are_off_by_default_and_the_openapi_document_is_served(
        api: Served, tmp_path: Path) -> None:
    # Swagger UI and ReDoc pull their JavaScript from a CDN.
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        response = await api.http.get(path)
        assert response.status_code == 404, (path, response.text[:200])
        assert "cdn" not in response.text.lower()
    document = await api.http.get("/openapi.json")
    assert document.status_code == 200 and document.json()["info"]["title"] == "compactd"
    config = api_config(f"sqlite:///{tmp_path}/docs.sqlite3", tmp_path, api={"docs": True})
    async for served in serve_app(config):
        assert (await served.http.get("/docs")).status_code == 200
        assert (await served.http.get("/redoc")).status_code == 200
