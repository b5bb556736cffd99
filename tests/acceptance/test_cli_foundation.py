"""The CLI as a subprocess: migrate, ingest, surface, verify, demo; bad input exits 2."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from compactd.scheduler.samples import coding_session
from tests.conftest import run_cli as run
from tests.support.services import (
    admin_execute,
    create_database_sync,
    drop_database_sync,
    with_database,
)

SAMPLE = coding_session(steps=12, big_output_lines=40)


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, cli_env: dict[str, str]) -> dict[str, str]:
    if request.param == "postgres":
        cli_env["COMPACTD_DATABASE_URL"] = request.getfixturevalue("clean_pg")
    return cli_env


@pytest.fixture(params=["sqlite", "postgres"])
def bare_env(request: pytest.FixtureRequest, bare_cli_env: dict[str, str]) -> dict[str, str]:
    """``env`` with an empty home: ``migrate`` creates the embedded database."""
    if request.param == "postgres":
        bare_cli_env["COMPACTD_DATABASE_URL"] = request.getfixturevalue("clean_pg")
    return bare_cli_env


@pytest.fixture
def transcript(tmp_path: Path) -> Path:
    path = tmp_path / "session.jsonl"
    path.write_text(SAMPLE.jsonl())
    return path


def test_migrate_ingest_verify_surface(bare_env: dict[str, str], transcript: Path) -> None:
    env = bare_env
    run(env, "migrate")
    out = run(env, "ingest", str(transcript), "--session", "s1", "--run-model", "gpt-4o",
              "--json")
    assert json.loads(out.stdout)["appended"] == len(SAMPLE.messages)
    assert "ok   s1" in run(env, "verify", "s1").stdout
    surface = json.loads(run(env, "surface", "s1", "--json").stdout)
    assert surface["session"] == "s1" and surface["version"] == 1
    assert [m["seq"] for m in surface["messages"]] == list(range(1, len(SAMPLE.messages) + 1))
    assert surface["tokens"] == sum(m["tokens"] for m in surface["messages"])
    assert [m["role"] for m in surface["messages"]] == [m["role"] for m in SAMPLE.messages]
    tool = next(m for m in surface["messages"] if m["role"] == "tool")
    assert tool["tool_call_id"] and tool["name"]
    assert "total:" in run(env, "surface", "s1").stdout


def test_ingest_appends_to_an_existing_session(env: dict[str, str], tmp_path: Path) -> None:
    run(env, "migrate")
    first = tmp_path / "a.jsonl"
    first.write_text(json.dumps({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}) + "\n")
    second = tmp_path / "b.jsonl"
    second.write_text(json.dumps({"role": "tool", "tool_call_id": "c1", "content": "x"}) + "\n")
    run(env, "ingest", str(first), "--session", "s2")
    run(env, "ingest", str(second), "--session", "s2")
    assert json.loads(run(env, "surface", "s2", "--json").stdout)["version"] == 2


def _call(cid: str) -> str:
    return json.dumps({"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]})


# The bad line is the last one of each list.
BAD_LINES = {
    "invalid JSON": ['{"role": "user", "content": "unterminated'],
    "unknown role": ['{"role": "robot", "content": "beep"}'],
    "orphan tool result": ['{"role": "tool", "tool_call_id": "never-called", "content": "x"}'],
    "reused open tool-call id": [_call("dup"), _call("dup")],
    "second result": [json.dumps({"role": "tool", "tool_call_id": "call_7_0001",
                                  "content": "again"})],
}


def test_bad_input_exits_2_naming_the_line_and_changes_nothing(
        env: dict[str, str], tmp_path: Path) -> None:
    """For each problem: lines 1-6 are valid (line 5 issues call_7_0001, line 6 answers it); then
    the bad case, its bad line last; then a valid line. Ingested into a new session and into an
    existing one; neither is created or changed. (One database for all the problems: each CLI
    call is a process start, and what one bad ingest left behind would show in the next.)"""
    run(env, "migrate")
    other = tmp_path / "other.jsonl"
    other.write_text(coding_session(steps=6, big_output_lines=10, call_prefix="other").jsonl())
    run(env, "ingest", str(other), "--session", "kept")
    before = run(env, "surface", "kept", "--json").stdout
    good = SAMPLE.messages[:6]
    for problem, lines in sorted(BAD_LINES.items()):
        bad_line = len(good) + len(lines)
        path = tmp_path / "bad.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in good)
                        + "".join(line + "\n" for line in lines)
                        + json.dumps({"role": "user", "content": "after"}) + "\n")
        for session in ("fresh", "kept"):
            out = run(env, "ingest", str(path), "--session", session, check=False)
            assert out.returncode == 2, (problem, session, out.stderr)
            assert f"line {bad_line}" in out.stderr, (problem, session, out.stderr)
            assert out.stdout == "", (problem, session)
        assert run(env, "surface", "kept", "--json").stdout == before, problem
    missing = run(env, "surface", "fresh", check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert run(env, "verify", "--all").returncode == 0


def test_unknown_session_and_missing_file_exit_2(env: dict[str, str], tmp_path: Path) -> None:
    run(env, "migrate")
    assert run(env, "surface", "nope", check=False).returncode == 2
    out = run(env, "ingest", str(tmp_path / "missing.jsonl"), "--session", "x", check=False)
    assert out.returncode == 2 and "cannot read" in out.stderr
    assert run(env, "bogus-command", check=False).returncode == 2


def test_postgres_without_schema_says_to_migrate(cli_env: dict[str, str], pg_url: str,
                                                  transcript: Path) -> None:
    url = with_database(pg_url, f"compactd_empty_{uuid.uuid4().hex[:8]}")
    create_database_sync(url)
    try:
        cli_env["COMPACTD_DATABASE_URL"] = url
        out = run(cli_env, "ingest", str(transcript), "--session", "s1", check=False)
        assert out.returncode == 2 and "compactd migrate" in out.stderr
    finally:
        drop_database_sync(url)


def test_a_password_with_a_slash_written_as_is_in_the_url_reaches_postgres(
        cli_env: dict[str, str], clean_pg: str, transcript: Path) -> None:
    """Generated passwords (base64) hold ``/`` and ``+``; SQLAlchemy's URL reads them unencoded,
    and the database URL check must not take the password for a host and its port."""
    role, password = f"compactd_slash_{uuid.uuid4().hex[:8]}", "pa/ss+w0rd"
    asyncio.run(admin_execute(clean_pg, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'; "
                                        f"GRANT pg_read_all_data, pg_write_all_data TO {role}"))
    try:
        server = urlparse(clean_pg)
        cli_env["COMPACTD_DATABASE_URL"] = (f"postgresql://{role}:{password}@{server.hostname}:"
                                            f"{server.port or 5432}{server.path}")
        out = run(cli_env, "ingest", str(transcript), "--session", "s1", "--json", check=False)
        assert out.returncode == 0, out.stderr
        surface = json.loads(run(cli_env, "surface", "s1", "--json").stdout)
        assert len(surface["messages"]) == len(SAMPLE.messages)
    finally:
        asyncio.run(admin_execute(clean_pg, f"DROP ROLE IF EXISTS {role}"))


def test_queueing_on_the_embedded_broker_says_only_what_was_queued(cli_env: dict[str, str],
                                                                   transcript: Path) -> None:
    """No server: ``compactd compact`` queues on the ``filesystem://`` broker, and kombu's
    warning about the URL's missing host ("Reverting to default 'localhost'") is noise the user
    cannot act on."""
    run(cli_env, "ingest", str(transcript), "--session", "s1")
    out = run(cli_env, "compact", "s1", "--force")
    assert "queued on compaction.urgent" in out.stdout
    assert "hostname" not in out.stderr.lower(), out.stderr
