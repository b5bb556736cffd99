"""The ``recallable`` layout on the user's path: ``summarization.layout: recallable`` in the
config file, a real ``celery -A compactd.worker.app worker`` on PostgreSQL and Redis, the fake
provider over HTTP (index calls and state calls answered as a model would, or failed on
purpose), runs asked for through the CLI; and ``compactd compact --inline`` on the embedded
SQLite.

After every pass: the log replays to the surface, the surface is a valid layout (index
checkpoints, then one state), the index checkpoints of earlier passes are byte-identical, and
every message compaction replaced reads back byte-exact through ``history_read``.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from compactd.scheduler.samples import coding_session
from compactd.storage.kinds import JournalKind, LayoutRole, NodeKind
from compactd.storage.recall import render_original
from compactd.worker.compaction.prompt import INDEX_MARK, SECTIONS
from compactd.worker.compaction.recall import layout_role
from tests.conftest import REPO
from tests.support import cli_launcher
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.stack import Stack, wait_until
from tests.support.worker_stack import db

pytestmark = pytest.mark.slow
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

MakeStack = Callable[..., Stack]

# Runs are asked for (compact --wait): they ignore the trigger, which only decides that a pass
# relieved the session; the index checkpoints may grow under it without a roll-up.
RECALLABLE = {"layout": "recallable", "trigger": [{"type": "tokens", "value": 24000}],
              "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
              "chunk_tokens": 1500, "index_summary_tokens": 60, "index_max_tokens": 20000,
              "trim_tokens_to_summarize": 16000}
# Words only the state's instruction holds (its eight sections), not an index call's.
STATE_CALL = SECTIONS[0]


def session(steps: int, seed: int, prefix: str) -> list[dict[str, Any]]:
    return coding_session(steps=steps, big_output_lines=40, seed=seed,
                          call_prefix=prefix).messages


def more(steps: int, seed: int, prefix: str) -> list[dict[str, Any]]:
    """Another stretch of work: the coding session without its system and opening messages."""
    return [m for m in session(steps, seed, prefix)[4:] if m["role"] != "system"]


def append(db: Db, sid: str, messages: list[dict[str, Any]]) -> None:
    from compactd.storage.messages import parse_openai

    db.run(lambda s: s.append(sid, [parse_openai(dict(m)) for m in messages]))


def roles(db: Db, sid: str) -> list[str | None]:
    return [layout_role(n) for n in db.surface(sid).nodes]


def index_nodes(db: Db, sid: str) -> list[tuple[int, Any, int]]:
    return [(n.seq, n.message.content, n.tokens) for n in db.surface(sid).nodes
            if layout_role(n) == LayoutRole.INDEX]


def assert_valid(db: Db, sid: str) -> None:
    """The log replays to the surface; index checkpoints, then at most one state."""
    verified = db.verify(sid)
    assert verified.ok, verified.problems
    found = roles(db, sid)
    assert found.count(LayoutRole.STATE) <= 1, found
    if LayoutRole.STATE in found:
        assert LayoutRole.INDEX not in found[found.index(LayoutRole.STATE):], found


def assert_every_replaced_message_reads_back(db: Db, sid: str) -> None:
    """Every message no longer on the surface comes back byte-exact from history_read of a
    node that names it."""
    events = db.events(sid, [NodeKind.MESSAGE])
    payloads = {e.seq: e.payload for e in events}
    surface = db.surface(sid)
    on_surface = {n.seq for n in surface.nodes}
    replaced = {seq for seq in payloads if seq not in on_surface}
    assert replaced
    refs = [n.message.meta["recall"]["ref"] for n in surface.nodes
            if isinstance(n.message.meta.get("recall"), dict)]
    exact: set[int] = set()
    for ref in refs:
        pages, seqs, offset = [], [], 0
        while True:
            page = db.run(lambda s, o=offset, r=ref: s.history_read(sid, r, o))
            pages.append(page.transcript)
            seqs += [q for q in page.seqs if not seqs or q != seqs[-1]]
            if page.cursor is None:
                break
            offset = page.cursor
        assert "".join(pages) == "".join(render_original(q, payloads[q]) for q in seqs), ref
        exact.update(seqs)
    assert replaced <= exact, sorted(replaced - exact)


def compact(stack: Stack, sid: str) -> dict[str, Any]:
    result: dict[str, Any] = stack.cli_json("compact", sid, "--wait", check=False)
    return result


def summaries(db: Db, sid: str) -> list[dict[str, Any]]:
    return [e.payload for e in db.events(sid, [JournalKind.SUMMARY])]


def test_passes_keep_index_checkpoints_byte_identical_one_state_and_every_original(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    stack = make_stack(summarization=RECALLABLE)
    db.ingest("L1", session(40, 1, "a"))
    stack.start_worker("w1", concurrency=4)
    frozen: list[tuple[int, Any, int]] = []
    for n in range(3):
        result = compact(stack, "L1")
        assert result["outcome"] == "committed", result
        assert_valid(db, "L1")
        index = index_nodes(db, "L1")
        assert index[:len(frozen)] == frozen, "an earlier index checkpoint changed"
        assert len(index) > len(frozen)
        assert roles(db, "L1").count(LayoutRole.STATE) == 1
        frozen = index
        append(db, "L1", more(20, 10 + n, f"m{n}"))
    assert_every_replaced_message_reads_back(db, "L1")
    # The index calls were asked for short entries and answered by the model; the usage of
    # every call of the last pass is on its run.
    journal = summaries(db, "L1")
    entries = [p for p in journal if p.get("layout") == LayoutRole.INDEX]
    assert entries and all(p["pointer"] is False and p["model"] == "fake-gpt" for p in entries)
    index_calls = [r for r in fake.requests if r.max_tokens == RECALLABLE["index_summary_tokens"]]
    assert len(index_calls) >= len(entries)
    [*_, last] = [r for r in db.runs("L1") if r.status == "committed"]
    states = [p for p in journal if p.get("layout") == LayoutRole.STATE]
    calls = sum(p["calls"] for p in journal[-(len(entries) + len(states)):]
                if p.get("run_id") == last.id)
    assert last.usage is not None and last.usage["calls"] == calls


def test_a_failed_chunk_call_degrades_to_a_pointer(make_stack: MakeStack, fake: FakeProvider,
                                                   db: Db) -> None:
    stack = make_stack(summarization=RECALLABLE, worker={"local_fallback": False})
    db.ingest("P1", session(40, 2, "p"))
    fake.script(Behaviour(model="fake-gpt", contains=INDEX_MARK, status=400, times=1))
    stack.start_worker("w1", concurrency=4)
    result = compact(stack, "P1")
    assert result["outcome"] == "committed", result
    assert_valid(db, "P1")
    entries = [p for p in summaries(db, "P1") if p.get("layout") == LayoutRole.INDEX]
    assert [p["pointer"] for p in entries].count(True) == 1, entries
    pointer = next(n for n in db.surface("P1").nodes
                   if n.message.meta.get("recall", {}).get("pointer"))
    assert "Not summarized:" in str(pointer.message.content)
    assert "history_read(checkpoint=" in str(pointer.message.content)
    assert roles(db, "P1").count(LayoutRole.STATE) == 1
    assert_every_replaced_message_reads_back(db, "P1")


def test_a_failed_state_call_leaves_a_valid_surface_the_next_pass_resumes(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    stack = make_stack(summarization=RECALLABLE, worker={"local_fallback": False})
    db.ingest("F1", session(40, 3, "f"))
    fake.script(Behaviour(model="fake-gpt", contains=STATE_CALL, status=400, times=1))
    stack.start_worker("w1", concurrency=4)
    result = compact(stack, "F1")
    assert (result["outcome"], result["failure_class"]) == ("partial", "summary"), result
    assert result["error"].startswith("committed "), result  # the index checkpoints
    assert_valid(db, "F1")
    kept = index_nodes(db, "F1")
    assert kept and LayoutRole.STATE not in roles(db, "F1"), "the index checkpoints stayed"
    # The session goes on; its next pass writes the state, reading what the failed one left.
    append(db, "F1", more(20, 30, "g"))
    result = compact(stack, "F1")
    assert result["outcome"] == "committed", result
    assert_valid(db, "F1")
    assert index_nodes(db, "F1")[:len(kept)] == kept
    [state] = [n for n in db.surface("F1").nodes if layout_role(n) == LayoutRole.STATE]
    # The state names everything the layout absorbed, the first pass's chunks included.
    first = min(n.message.meta["recall"]["first"] for n in db.surface("F1").nodes
                if layout_role(n) == LayoutRole.INDEX)
    assert state.message.meta["recall"]["first"] == first
    assert_every_replaced_message_reads_back(db, "F1")


def test_a_pass_killed_before_its_commit_is_done_again_from_the_log(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    """The worker dies while its pass waits for the second chunk's call, the other calls done:
    a pass commits once, when every call has ended, so the session is as it was, and the next
    pass (once the lease expired) does the whole pass from the log."""
    stack = make_stack(summarization=RECALLABLE, worker={"lease_s": 2.0})
    db.ingest("K1", session(40, 4, "k"))
    before = db.surface("K1").nodes
    chunks = stack.cli_json("plan", "K1", "--force")["summarize"]["chunks"]
    assert len(chunks) >= 3, chunks
    # A turn of the second chunk's: no other chunk's index call reads it (the state's does).
    marker = f'<turn seq="{chunks[1]["replace_seqs"][0]}"'
    fake.script(Behaviour(model="fake-gpt", contains=marker, hang=True, times=-1))
    stack.start_worker("w1", concurrency=4)
    stack.cli("compact", "K1")  # enqueued; the run's end will never come
    wait_until(lambda: sum(r.behaviour == "hang" for r in fake.requests) >= 1, timeout=60,
               what="the second chunk's call to hang")
    # Every other chunk's call answers while that one hangs.
    wait_until(lambda: sum(r.status == 200 and INDEX_MARK in json.dumps(r.body)
                           for r in fake.requests) >= len(chunks) - 1, timeout=60,
               what="the other chunks' calls")
    assert db.surface("K1").nodes == before  # nothing committed while a call is out
    stack.kill("w1")
    assert_valid(db, "K1")
    [killed] = [r for r in db.runs("K1") if r.status == "running"]

    fake.reset()
    stack.start_worker("w2", concurrency=4)
    wait_until(lambda: (db.session("K1").lease_expires_at or dt.datetime.now(dt.UTC))
               <= dt.datetime.now(dt.UTC), timeout=30, what="the lease to expire")
    result = compact(stack, "K1")
    assert result["outcome"] == "committed", result
    assert_valid(db, "K1")
    assert len(index_nodes(db, "K1")) == len(chunks)
    [state] = [n for n in db.surface("K1").nodes if layout_role(n) == LayoutRole.STATE]
    assert state.message.meta["recall"]["first"] == chunks[0]["replace_seqs"][0]
    abandoned = next(r for r in db.runs("K1") if r.id == killed.id)
    assert (abandoned.status, abandoned.failure_class) == ("failed", "abandoned")
    assert_every_replaced_message_reads_back(db, "K1")


def test_inline_on_sqlite_plan_surface_and_verify(cli_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    """The embedded default: no models configured (the local summarizer writes the entries and
    the state), the CLI compacting in its own process, twice."""
    config = tmp_path / "compactd.yaml"
    config.write_text(yaml.safe_dump({"summarization": {
        key: value for key, value in RECALLABLE.items() if key != "model_name"}}))
    env = {**cli_env, "COMPACTD_CONFIG": str(config)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        out = cli_launcher.run(env, args, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        return out

    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in session(40, 5, "s")))
    cli("migrate")
    cli("ingest", str(path), "--session", "s1")
    human = cli("plan", "s1", "--force").stdout
    assert "recallable pass (insert)" in human and "  index c" in human, human
    plan = json.loads(cli("plan", "s1", "--json", "--force").stdout)
    assert plan["layout"] == "recallable"
    step = plan["summarize"]
    assert step["mode"] == "insert" and len(step["chunks"]) >= 2
    assert all(c["checkpoint"] == f"c{c['replace_seqs'][0]}-{c['replace_seqs'][-1]}"
               for c in step["chunks"])
    assert step["state"]["checkpoint"].startswith("s") and step["state"]["calls"]
    for n in range(2):
        out = json.loads(cli("compact", "s1", "--inline", "--json").stdout)
        assert out["outcome"] == "committed", out
        assert "verified" in cli("verify", "s1").stdout
        extra = tmp_path / f"more{n}.jsonl"
        extra.write_text("".join(json.dumps(m) + "\n" for m in more(20, 50 + n, f"x{n}")))
        cli("ingest", str(extra), "--session", "s1")
    for form in ("durable_context", "compacted_summary", "langchain"):
        messages = json.loads(cli("surface", "s1", "--json", "--render", form).stdout)["messages"]
        layout = [m for m in messages if isinstance(m.get("meta", {}).get("recall"), dict)
                  and m["meta"]["recall"].get("layout")]
        kinds = [m["meta"]["recall"]["layout"] for m in layout]
        assert kinds.count(LayoutRole.STATE) == 1 and kinds.count(LayoutRole.INDEX) >= 3, kinds
        assert all(m["meta"]["render"] == form for m in layout)
        state = next(m for m in layout if m["meta"]["recall"]["layout"] == LayoutRole.STATE)
        assert "## Current Work" in state["content"] and "history_read(" in state["content"]


@pytest.mark.timeout(120)
async def test_an_overflow_report_runs_a_pass(make_stack: MakeStack, fake: FakeProvider) -> None:
    """A runtime's overflow report through the client: the forced plan is a pass (no prune
    applies here), so it is enqueued and answered with the smaller surface."""
    from compactd.scheduler.client import CompactdClient
    from tests.support.stack_sessions import config_of

    stack = make_stack(summarization=RECALLABLE)
    stack.start_worker("w1", concurrency=4)
    async with CompactdClient(config_of(stack)) as client:
        handle = await client.create_session("O1", run_model="fake-gpt")
        await handle.append([{"role": "user", "content": "fix the ledger"}, *more(30, 6, "o")])
        forced = stack.cli_json("plan", "O1", "--force")
        assert forced["prune"] == [] and forced["summarize"]["chunks"], forced
        result = await handle.report_overflow(timeout_s=60)
        assert result.compacted, result.reason
        assert result.run is not None and result.run["outcome"] == "committed"
        kinds = [m["meta"]["recall"]["layout"] for m in result.messages or []
                 if isinstance((m.get("meta") or {}).get("recall"), dict)
                 and m["meta"]["recall"].get("layout")]
        assert kinds.count(LayoutRole.STATE) == 1 and LayoutRole.INDEX in kinds
