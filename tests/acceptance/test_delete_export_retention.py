"""Deletion, retention and export on the user's path: ``compactd export | ingest | verify`` as
subprocesses on both backends, ``compactd delete`` while a real worker's run waits on its model,
``DELETE /v1/sessions/{id}`` on a served API with two tenants, and retention's purge run by a real
beat and worker."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from compactd.scheduler.samples import coding_session
from compactd.storage.deletion import DELETER
from compactd.storage.errors import SessionNotFound
from tests.conftest import run_cli
from tests.support.api import TOKEN_A, TOKEN_B, bearer, start_api
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.probes import free_port
from tests.support.stack import Stack, wait_until
from tests.support.tables import row_counts, session_row_counts

pytestmark = pytest.mark.slow

MakeStack = Callable[..., Stack]
ONE_CALL = {"keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
            "trim_tokens_to_summarize": 16000}


def odd_messages() -> list[dict[str, Any]]:
    """What a log can hold that a careless export would change: NUL, non-ASCII, an emoji
    outside the BMP, the line and paragraph separators (a line break to some readers), CR,
    a large tool result, content blocks, tool calls, a name, pass-through fields and meta."""
    big = "".join(f"{i:06d} résumé ✓ \x00\n" for i in range(50_000))
    assert len(big.encode()) > 1 << 20, "a tool result over a MiB"
    return [
        {"role": "system", "content": "Du bist ein Agent. 你好 \u2028 \u2029 \r\n end"},
        {"role": "user", "content": "NUL:\x00 tab:\t quote:\" backslash:\\ 😀",
         "meta": {"pinned": True, "score": 1.5, "nested": {"k": [1, None, "ü"]}}},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "read_file", "arguments": "{\"path\": \"/tmp/ä\\u0000\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "grep", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": big},
        {"role": "tool", "tool_call_id": "call_2", "content": [
            {"type": "text", "text": "block one"}, {"type": "text", "text": "two \x00"}]},
        {"role": "assistant", "content": "", "name": "agent-7"},
        {"role": "user", "content": "   "},
    ]


@pytest.fixture(params=["sqlite", "postgres"])
def backend_env(request: pytest.FixtureRequest, cli_env: dict[str, str]) -> dict[str, str]:
    """The CLI's environment on the embedded SQLite file, or on PostgreSQL."""
    if request.param == "postgres":
        return {**cli_env, "COMPACTD_DATABASE_URL": str(request.getfixturevalue("clean_pg"))}
    return cli_env


def test_export_ingest_verify_round_trips_byte_exact(backend_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    messages = odd_messages() + coding_session(steps=30, seed=3).messages[1:]
    source.write_text("".join(json.dumps(m) + "\n" for m in messages), encoding="utf-8")
    run_cli(backend_env, "ingest", str(source), "--session", "a")
    # A compaction replaced part of the surface: the export is still the whole log.
    out = json.loads(run_cli(backend_env, "compact", "a", "--inline", "--force", "--json").stdout)
    assert out["outcome"] == "committed", out

    first = run_cli(backend_env, "export", "a").stdout.encode()
    exported = tmp_path / "a.jsonl"
    exported.write_bytes(first)
    lines = first.split(b"\n")
    assert lines[-1] == b"" and len(lines) - 1 == len(messages)
    # The same messages, field for field, as they were ingested.
    assert [json.loads(line) for line in lines[:-1]] == messages
    run_cli(backend_env, "ingest", str(exported), "--session", "b")
    again = run_cli(backend_env, "export", "b").stdout.encode()
    assert again == first
    assert "1/1 sessions verified" in run_cli(backend_env, "verify", "b").stdout
    surface_b = json.loads(run_cli(backend_env, "surface", "b", "--json").stdout)
    assert [m["content"] for m in surface_b["messages"]] == [m.get("content") for m in messages]


def test_export_and_delete_refuse_bad_input(backend_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(backend_env, "export", "nobody", check=False)
    assert out.returncode == 2 and out.stdout == ""
    assert "session 'nobody' does not exist" in out.stderr
    out = run_cli(backend_env, "delete", "nobody", check=False)
    assert out.returncode == 2 and "session 'nobody' does not exist" in out.stderr
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"role": "user", "content": "hi"}) + "\n")
    run_cli(backend_env, "ingest", str(source), "--session", "mine", "--tenant", "acme")
    out = run_cli(backend_env, "delete", "mine", "--tenant", "globex", check=False)
    assert out.returncode == 2 and "does not exist" in out.stderr
    assert run_cli(backend_env, "export", "mine").stdout.count("\n") == 1
    out = run_cli(backend_env, "delete", "mine", "--tenant", "bad tenant\x7f", check=False)
    assert out.returncode == 2
    deleted = json.loads(run_cli(backend_env, "delete", "mine", "--json").stdout)
    assert deleted["deleted"] is True and deleted["rows"]["events"] == 1
    assert run_cli(backend_env, "export", "mine", check=False).returncode == 2


@pytest.mark.parametrize(("value", "said"), [
    (0, "greater than 0"), (-3, "greater than 0"), ("thirty", "valid number"),
    (True, "valid number"), (".inf", "finite number")])
def test_a_retention_that_is_not_a_positive_number_is_refused_at_load(
        bare_cli_env: dict[str, str], tmp_path: Path, value: Any, said: str) -> None:
    for key in ("originals_days", "sessions_idle_days"):
        config = tmp_path / "compactd.yaml"
        text = f"retention:\n  {key}: {value if value != '.inf' else '.inf'}\n"
        config.write_text(text.replace("True", "true"))
        out = run_cli({**bare_cli_env, "COMPACTD_CONFIG": str(config)}, "status", check=False)
        assert out.returncode == 2, out
        assert out.stderr.startswith(f"compactd: retention.{key}: "), out.stderr
        assert said in out.stderr, out.stderr
    # Nothing was created: the refusal came before any database was opened.
    assert not (tmp_path / "compactd.sqlite3").exists()


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


def test_a_deletion_cancels_the_run_in_flight_which_commits_nothing(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    stack = make_stack(summarization={**ONE_CALL, "trigger": [{"type": "tokens", "value": 3000}]},
                       worker={"lease_s": 3.0, "sweep_interval_s": 3600})
    messages = coding_session(steps=20, big_output_lines=30, seed=7).messages
    db.ingest("doomed", messages)
    db.ingest("other", messages)
    stack.start_worker("w1", concurrency=2)
    fake.script(Behaviour(model="fake-gpt", hang=True, times=1))
    stack.cli("compact", "doomed")
    wait_until(lambda: fake.requests, timeout=30, what="the run's model call to hang")
    [held] = [r for r in db.runs("doomed") if r.status == "running"]

    deleted = stack.cli_json("delete", "doomed")
    assert deleted["cancelled_run"] == held.id, deleted

    entry = wait_until(lambda: stack.task_ended("w1", held.task_id), timeout=60,
                       what="the held run's task to end")
    # The run ended cancelled, as asked: its task succeeds and says who ended it.
    assert entry["level"] == "info" and " succeeded in " in entry["msg"], entry
    assert "'failure_class': 'cancelled'" in entry["msg"], entry["msg"]
    assert f"'released_by': '{DELETER}'" in entry["msg"], entry["msg"]
    ends = [json.loads(line) for line in stack.log("w1").splitlines()
            if line.startswith("{") and '"compaction.end"' in line]
    assert any(e.get("failure_class") == "cancelled" for e in ends), ends
    # Nothing of the session came back: the run's end found no session to write to.
    left = db.run(lambda store: session_row_counts(store, "doomed"))
    assert set(left.values()) == {0}, left
    assert db.run(lambda store: store.verify("other")).ok
    # The worker goes on: the other session compacts.
    out = stack.cli_json("compact", "other", "--wait", "--timeout", "60")
    assert out["outcome"] == "committed", out
    assert stack.procs["w1"].poll() is None


def test_http_delete_is_for_the_sessions_tenant_only(make_stack: MakeStack, db: Db) -> None:
    stack = make_stack(summarization={"trigger": [{"type": "tokens", "value": 1_000_000_000}]})
    url = start_api(stack)
    step = [{"role": "user", "content": "hello ü \u0000"}, {"role": "assistant", "content": "hi"}]
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.put("/v1/sessions/a1", headers=bearer(TOKEN_A), json={}).status_code == 201
        assert http.post("/v1/sessions/a1/messages", headers=bearer(TOKEN_A),
                         json={"messages": step}).status_code == 200
        before = db.run(row_counts)

        answer = http.delete("/v1/sessions/a1", headers=bearer(TOKEN_B))
        assert answer.status_code == 404, answer.text
        # As a session that does not exist: nothing tells tenant B that it does.
        missing = http.delete("/v1/sessions/a2", headers=bearer(TOKEN_B))
        assert missing.status_code == 404
        assert answer.text == missing.text.replace("a2", "a1")
        assert db.run(row_counts) == before
        assert http.delete("/v1/sessions/a1").status_code == 401
        assert http.delete("/v1/sessions/%20bad%7F", headers=bearer(TOKEN_A)).status_code == 422
        assert db.run(row_counts) == before

        answer = http.delete("/v1/sessions/a1", headers=bearer(TOKEN_A))
        assert answer.status_code == 200, answer.text
        assert answer.json()["rows"]["events"] == 2 and answer.json()["deleted"] is True
        assert http.get("/v1/sessions/a1", headers=bearer(TOKEN_A)).status_code == 404
        assert http.post("/v1/sessions/a1/messages", headers=bearer(TOKEN_A),
                         json={"messages": step}).status_code == 404
        assert http.delete("/v1/sessions/a1", headers=bearer(TOKEN_A)).status_code == 404
    assert db.run(row_counts) == dict.fromkeys(before, 0)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_retention_purges_idle_sessions_by_a_beat_run(make_stack: MakeStack, db: Db) -> None:
    port = free_port()
    # Idle for a tenth of a second's worth of days: the session is idle by the first purge.
    stack = make_stack(extra_config={"retention": {"sessions_idle_days": 1e-6,
                                                   "originals_days": 1e-6, "interval_s": 1}},
                       worker={"metrics_port": port, "sweep_interval_s": 3600})
    db.ingest("idle", coding_session(steps=10, seed=5).messages)
    assert "retention: never ran" in stack.cli("status").stdout
    stack.start_worker("w1", concurrency=2)
    stack.start_beat()

    def purged() -> bool:
        try:
            db.session("idle")
        except SessionNotFound:
            return True
        return False

    wait_until(purged, timeout=60, what="retention to purge the idle session")
    status = stack.cli_json("status")["retention"]
    assert status is not None and status["last_run_at"], status
    metrics = wait_until(lambda: (m := _scrape(port)).get(
        ("compactd_retention_purged_total", (("what", "sessions"),))) and m,
        timeout=30, what="the purge's metrics")
    assert metrics[("compactd_retention_purged_total", (("what", "sessions"),))] >= 1
    assert metrics[("compactd_retention_last_run_timestamp_seconds", ())] > 0
    assert "retention: last ran" in stack.cli("status").stdout
    assert db.run(row_counts)["events"] == 0
