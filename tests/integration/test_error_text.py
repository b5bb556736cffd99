"""What a storage error says at the doors: its class and SQLSTATE (or the operating system's
reason), never the driver's text, the SQL or message content. The database is made to fail on
purpose (a trigger refusing every event row, quoting the row like a driver error can) on real
PostgreSQL and SQLite, and the error is provoked over HTTP (body and log lines) and through the
CLI (stderr)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from compactd.scheduler.cli import main
from compactd.storage.migrate import upgrade
from compactd.storage.store import Store
from tests.support.asgi import A, api_config, serve_app
from tests.support.services import (
    create_database_sync,
    drop_database_sync,
    with_database,
)

SECRET = "TOPSECRET-CONTENT-42"
# What the failing statement and the driver would say: none of it may be shown.
LEAKS = (SECRET, "INSERT", "refused by a test trigger", "events", "compactd_append", "SELECT",
         "Traceback")
PG_TRIGGER = """
CREATE FUNCTION refuse_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'refused by a test trigger: INSERT INTO events VALUES (%)', NEW.payload;
END $$;
CREATE TRIGGER refuse_event BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION refuse_event();
"""
SQLITE_TRIGGER = ("CREATE TRIGGER refuse_event BEFORE INSERT ON events BEGIN "
                  "SELECT RAISE(ABORT, 'refused by a test trigger: INSERT INTO events'); END")


class Faulty:
    """A migrated database of its own, and a way to make every event insert fail."""

    def __init__(self, url: str, break_events: Callable[[], None]) -> None:
        self.url = url
        self.break_events = break_events


@pytest.fixture(params=["sqlite", "postgres"])
def faulty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Faulty]:
    if request.param == "sqlite":
        path = tmp_path / "faulty.sqlite3"
        url = f"sqlite:///{path}"
        upgrade(url)

        def break_sqlite() -> None:
            with sqlite3.connect(path) as conn:
                conn.execute(SQLITE_TRIGGER)

        yield Faulty(url, break_sqlite)
        return
    pg_url = request.getfixturevalue("pg_url")
    url = with_database(pg_url, f"compactd_faults_{uuid.uuid4().hex[:8]}")
    create_database_sync(url)
    try:
        upgrade(url)
        yield Faulty(url, lambda: asyncio.run(_pg_execute(url, PG_TRIGGER)))
    finally:
        drop_database_sync(url)


async def _pg_execute(url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def assert_clean(text: str) -> None:
    for leak in LEAKS:
        assert leak not in text, (leak, text)


async def surface_size(url: str) -> int:
    store = Store.from_url(url)
    try:
        return len((await store.read_surface("s1")).nodes)
    finally:
        await store.close()


async def test_a_storage_error_over_http_names_no_sql_driver_text_or_content(
        faulty: Faulty, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async for served in serve_app(api_config(faulty.url, tmp_path)):
        await served.create("s1", A)
        await asyncio.to_thread(faulty.break_events)
        response = await served.append("s1", A, {"role": "user", "content": SECRET})
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["error"] == "unavailable"
        assert body["message"].startswith("database error: "), body
        assert_clean(response.text)
    logged = "\n".join(r.getMessage() + repr(vars(r)) for r in caplog.records)
    assert "storage failed" in logged  # the failure is logged, without its text
    assert_clean(logged)
    assert await surface_size(faulty.url) == 0


def test_a_storage_error_through_the_cli_names_no_sql_driver_text_or_content(
        faulty: Faulty, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name in list(os.environ):
        if name.startswith("COMPACTD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COMPACTD_HOME", str(tmp_path))
    monkeypatch.setenv("COMPACTD_DATABASE_URL", faulty.url)
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps({"role": "user", "content": "kept"}) + "\n")
    assert main(["ingest", str(first), "--session", "s1"]) == 0
    faulty.break_events()
    capsys.readouterr()
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"role": "user", "content": SECRET}) + "\n")
    assert main(["ingest", str(secret), "--session", "s1"]) == 1
    out = capsys.readouterr()
    assert out.err.startswith("compactd: database error: "), out.err
    assert out.err.count("\n") == 1
    assert_clean(out.err + out.out)
    assert asyncio.run(surface_size(faulty.url)) == 1


async def test_a_broker_error_over_http_says_retry_and_logs_the_broker_without_its_password(
        db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    config = api_config(db_url, tmp_path, broker_url="redis://compactd:hunter2@127.0.0.1:1/0",
                        summarization={"trigger": [{"type": "messages", "value": 1}],
                                       "keep": {"type": "tokens", "value": 1}})
    async for served in serve_app(config):
        await served.create("s1", A)
        await served.append("s1", A, {"role": "user", "content": "a"},
                            {"role": "assistant", "content": "b"})
        await served.app.state.api.client.drain()
        response = await served.http.post("/v1/sessions/s1/compact", headers=A, json={})
        assert response.status_code == 503, response.text
        assert response.json()["message"] == "the broker cannot be reached; retry"
    logged = "\n".join(r.getMessage() for r in caplog.records
                       if r.name.startswith("compactd.scheduler.http"))
    assert "the broker cannot be reached at redis://compactd:***@127.0.0.1:1/0" in logged
    assert "hunter2" not in logged


async def test_a_database_that_cannot_be_reached_is_503_without_its_address(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    config = api_config("postgresql://compactd:hunter2@127.0.0.1:1/compactd", tmp_path)
    async for served in serve_app(config):
        for response in (await served.http.get("/v1/sessions/s1", headers=A),
                         await served.http.get("/healthz")):
            assert response.status_code == 503, response.text
            assert response.json()["message"] == "the database cannot be reached; retry"
    logged = "\n".join(r.getMessage() for r in caplog.records
                       if r.name.startswith("compactd.scheduler.http"))
    assert "the database cannot be reached" in logged and "hunter2" not in logged


async def test_a_database_that_does_not_exist_is_503_without_its_name(
        pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Not "retry" (a typo does not heal), and the name is the operator's (the log), not the
    # caller's.
    caplog.set_level(logging.INFO)
    config = api_config(pg_url.rsplit("/", 1)[0] + "/compactd_no_such_database", tmp_path)
    async for served in serve_app(config):
        response = await served.http.get("/v1/sessions/s1", headers=A)
        assert response.status_code == 503, response.text
        assert response.json()["message"] == "the server's database is not configured correctly"
    logged = "\n".join(r.getMessage() for r in caplog.records
                       if r.name.startswith("compactd.scheduler.http"))
    assert "'compactd_no_such_database' does not exist" in logged
