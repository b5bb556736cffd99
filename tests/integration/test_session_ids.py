"""Session creation and session ids at every door: the HTTP API (in process, lifespan included)
and the runtime client, on real SQLite and PostgreSQL.

Creating a session is idempotent: callers racing to create one new session all succeed (one of
them created it) unless their settings conflict, which answers 409 naming the setting. An id is
printable text, valid UTF-8, at most 255 characters, on every path. A number that ends in an
INTEGER column or bounds a wait is checked before anything is written or sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from compactd.scheduler.client import Client, CompactdClient
from compactd.storage.errors import ConfigError, InvalidMessage, SessionExists
from compactd.storage.store import Store
from compactd.worker.settings import Config, Settings, build_config
from tests.support.asgi import A, B, Served, api_config, serve_app
from tests.support.enqueuer import RecordingEnqueuer

RACERS = 8


@pytest.fixture
async def api(db_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    async for served in serve_app(api_config(db_url, tmp_path)):
        yield served


@pytest.fixture
def config(db_url: str) -> Config:
    return build_config({}, settings=Settings(database_url=db_url, broker_url="memory://"))


@pytest.fixture
async def client(config: Config, store: Store) -> AsyncIterator[CompactdClient]:
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as c:
        yield c


# ------------------------------------------------------------------------------------------
# creating one new session concurrently


async def test_concurrent_puts_of_one_new_session_all_succeed_and_one_created_it(
        api: Served) -> None:
    body = {"run_model": "gpt-4o", "context_window": 128_000,
            "envelope": {"system": "You are terse."}}
    responses = await asyncio.gather(*[
        api.http.put("/v1/sessions/race", headers=A, json=body) for _ in range(RACERS)])
    assert all(r.status_code in (200, 201) for r in responses), [r.text for r in responses]
    assert sorted(r.status_code for r in responses) == [200] * (RACERS - 1) + [201]
    assert [r.json()["created"] for r in responses].count(True) == 1
    assert {r.json()["run_model"] for r in responses} == {"gpt-4o"}
    status = await api.http.get("/v1/sessions/race", headers=A)
    assert status.status_code == 200 and status.json()["tenant"] == "tenant-a"


async def test_concurrent_puts_with_another_run_model_answer_409_naming_it(
        api: Served) -> None:
    models = ["gpt-4o", "claude-x"] * (RACERS // 2)
    responses = await asyncio.gather(*[
        api.http.put("/v1/sessions/race", headers=A, json={"run_model": model})
        for model in models])
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 201, 409} and codes.count(201) == 1, [r.text for r in responses]
    winner = responses[codes.index(201)].json()["run_model"]
    for model, response in zip(models, responses, strict=True):
        if model == winner:
            assert response.status_code in (200, 201), response.text
        else:
            assert response.status_code == 409, response.text
            body = response.json()
            assert body["error"] == "conflict" and "run_model" in body["message"]
            assert winner in body["message"] and model in body["message"]


async def test_concurrent_puts_without_a_run_model_open_the_one_created_with_it(
        api: Served) -> None:
    bodies = [{"run_model": "gpt-4o"}, {}] * (RACERS // 2)
    responses = await asyncio.gather(*[
        api.http.put("/v1/sessions/race", headers=A, json=body) for body in bodies])
    codes = sorted(r.status_code for r in responses)
    # Whoever wins, a body without a run model opens the session as it would a moment later;
    # only a body created without one can make a later gpt-4o body conflict.
    assert codes.count(201) == 1 and set(codes) <= {200, 201, 409}, [r.text for r in responses]
    winner = next(r for r in responses if r.status_code == 201).json()["run_model"]
    for body, response in zip(bodies, responses, strict=True):
        if "run_model" not in body or winner == "gpt-4o":
            assert response.status_code in (200, 201), response.text


async def test_concurrent_puts_from_two_tenants_give_the_id_to_one(api: Served) -> None:
    tenants = [A, B] * (RACERS // 2)
    responses = await asyncio.gather(*[
        api.http.put("/v1/sessions/race", headers=headers, json={}) for headers in tenants])
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 201, 404} and codes.count(201) == 1, [r.text for r in responses]
    owner = responses[codes.index(201)].json()["tenant"]
    for response in responses:
        if response.status_code == 404:
            assert response.json()["error"] == "not_found"
        else:
            assert response.json()["tenant"] == owner


async def test_client_create_session_racing_is_idempotent(client: CompactdClient,
                                                          store: Store) -> None:
    handles = await asyncio.gather(*[
        client.create_session("race", run_model="gpt-4o", context_window=128_000)
        for _ in range(RACERS)])
    assert {h.info.run_model for h in handles} == {"gpt-4o"}
    assert {h.info.created_at for h in handles} == {handles[0].info.created_at}
    results = await asyncio.gather(*[
        client.create_session("race2", run_model=model)
        for model in ["gpt-4o", "claude-x"] * (RACERS // 2)], return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, SessionExists) for e in errors), errors
    assert all("run_model" in str(e) for e in errors)
    assert len(errors) == RACERS // 2


# ------------------------------------------------------------------------------------------
# what an id may be


@pytest.mark.parametrize(("raw", "problem"), [
    ("x%FFy", "UTF-8"),  # both become x\ufffdy once decoded: one session for two ids
    ("x%FEy", "UTF-8"),
    ("x%EF%BF%BDy", "U+FFFD"),
    ("x%00y", "control character"),
    ("x%1By", "control character"),
    ("x%7Fy", "control character"),
    ("x%C2%85y", "control character"),  # NEL, a C1 control character
    ("%20%20", "blank"),
])
async def test_an_id_that_is_not_printable_utf8_is_422_on_every_route_and_stores_nothing(
        api: Served, store: Store, raw: str, problem: str) -> None:
    for method, path in (("PUT", ""), ("GET", ""), ("GET", "/surface"),
                         ("POST", "/messages")):
        body = {"messages": [{"role": "user", "content": "x"}]} if path else {}
        response = await api.http.request(method, f"/v1/sessions/{raw}{path}", headers=A,
                                          **({} if method == "GET" else {"json": body}))
        assert response.status_code == 422, (method, path, response.text)
        assert response.json()["field"] == "path.session_id"
        assert problem in response.json()["message"], response.text
        assert "Value error" not in response.json()["message"]
    assert await store.list_sessions() == []


async def test_two_ids_that_differ_only_in_undecodable_bytes_never_share_a_session(
        api: Served, store: Store) -> None:
    first = await api.http.put("/v1/sessions/x%FFy", headers=B, json={})
    second = await api.http.put("/v1/sessions/x%FEy", headers=A, json={})
    assert (first.status_code, second.status_code) == (422, 422), (first.text, second.text)
    assert await store.list_sessions() == []


@pytest.mark.parametrize(("kwargs", "field", "problem"), [
    ({"session_id": "a\0b"}, "session", "control character"),
    ({"session_id": "a\x85b"}, "session", "control character"),
    ({"session_id": "a\udcffb"}, "session", "UTF-8"),
    ({"session_id": "a\ufffdb"}, "session", "U+FFFD"),
    ({"session_id": " "}, "session", "blank"),
    ({"session_id": "x" * 256}, "session", "255"),
    ({"session_id": 7}, "session", "string"),
    ({"session_id": "ok", "tenant": "t\0"}, "tenant", "control character"),
    ({"session_id": "ok", "tenant": ""}, "tenant", "blank"),
])
async def test_the_client_refuses_a_bad_id_or_tenant_naming_it_and_stores_nothing(
        client: CompactdClient, store: Store, kwargs: dict[str, object], field: str,
        problem: str) -> None:
    kwargs = dict(kwargs)
    session_id = kwargs.pop("session_id")
    with pytest.raises(InvalidMessage) as raised:
        await client.create_session(session_id, **kwargs)  # type: ignore[arg-type]
    assert raised.value.field == field and problem in raised.value.reason
    if field == "session":
        with pytest.raises(InvalidMessage):
            await client.get_session(session_id)  # type: ignore[arg-type]
    with pytest.raises(InvalidMessage):
        await store.create_session(session_id, **kwargs)  # type: ignore[arg-type]
    assert await store.list_sessions() == []


async def test_a_run_model_follows_the_same_rule_in_the_client_and_over_http(
        client: CompactdClient, api: Served, store: Store) -> None:
    for model in ("gpt\0", "gpt\ufffd", "gpt\x85"):
        with pytest.raises(InvalidMessage) as raised:
            await client.create_session("s1", run_model=model)
        assert raised.value.field == "run_model"
        response = await api.http.put("/v1/sessions/s1", headers=A, json={"run_model": model})
        assert response.status_code == 422 and response.json()["field"] == "body.run_model"
    assert await store.list_sessions() == []


@pytest.mark.parametrize("tenant", ["a\ufffd", "a\x85", "a\0"])
def test_a_configured_tenant_name_follows_the_same_rule(tmp_path: Path, tenant: str) -> None:
    with pytest.raises(ConfigError, match="tenant"):
        build_config({"api": {"tokens": [{"tenant": tenant, "token_sha256": "0" * 64}]}},
                     settings=Settings(database_url="sqlite:///x.db"), home=tmp_path)


def test_the_sync_client_refuses_a_nul_in_a_session_id(config: Config, db_url: str) -> None:
    with Client(config) as client:
        with pytest.raises(InvalidMessage, match="control character"):
            client.create_session("a\0b")
        client.create_session("a-b")


# ------------------------------------------------------------------------------------------
# numbers


@pytest.mark.parametrize("value", [2**31, 2**63, -1, True, 5.0, "5", None])
async def test_report_usage_refuses_what_the_column_cannot_hold_naming_input_tokens(
        client: CompactdClient, store: Store, value: object) -> None:
    handle = await client.create_session("s1")
    with pytest.raises(InvalidMessage) as raised:
        await handle.report_usage(value)  # type: ignore[arg-type]
    assert raised.value.field == "input_tokens"
    assert (await store.get_session("s1")).reported_input_tokens is None
    assert (await handle.report_usage(2**31 - 1)).reported_input_tokens == 2**31 - 1


def test_the_sync_client_refuses_usage_over_the_column(config: Config) -> None:
    with Client(config) as client:
        session = client.create_session("s1")
        with pytest.raises(InvalidMessage, match="input_tokens"):
            session.report_usage(2**31)


@pytest.mark.parametrize("value", [2**31, 0, -3, True, 1.5])
async def test_create_session_refuses_a_context_window_the_column_cannot_hold(
        client: CompactdClient, store: Store, value: object) -> None:
    with pytest.raises(InvalidMessage) as raised:
        await client.create_session("s1", context_window=value)  # type: ignore[arg-type]
    assert raised.value.field == "context_window"
    assert await store.list_sessions() == []


def test_a_model_window_the_column_cannot_hold_is_refused_when_the_config_loads(
        tmp_path: Path) -> None:
    model = {"name": "big", "provider": "local", "context_window": 2**31}
    with pytest.raises(ConfigError, match=r"models\[0\]\.context_window"):
        build_config({"models": [model]}, settings=Settings(database_url="sqlite:///x.db"),
                     home=tmp_path)


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), 0, -1.0, True])
async def test_a_wait_that_would_never_end_is_refused_before_anything_is_sent(
        client: CompactdClient, timeout_s: float) -> None:
    handle = await client.create_session("s1")
    with pytest.raises(InvalidMessage) as raised:
        await handle.compact(timeout_s=timeout_s)
    assert raised.value.field == "timeout_s"
    with pytest.raises(InvalidMessage, match="seconds"):
        await handle.report_overflow(timeout_s=timeout_s)
    assert client.enqueuer.sent == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/usage", {"input_tokens": 2**31}, "body.input_tokens"),
    ("/usage", {"input_tokens": 2**63}, "body.input_tokens"),
    ("/usage", {"input_tokens": True}, "body.input_tokens"),
    ("/usage", {"input_tokens": 1.5}, "body.input_tokens"),
    ("", {"context_window": 2**31}, "body.context_window"),
])
async def test_numbers_the_columns_cannot_hold_are_422_over_http(
        api: Served, store: Store, path: str, body: dict[str, object], field: str) -> None:
    await api.create("s1", A)
    method = "POST" if path else "PUT"
    response = await api.http.request(method, f"/v1/sessions/s1{path}", headers=A, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    info = await store.get_session("s1")
    assert info.reported_input_tokens is None and info.context_window is None
