"""Provider usage feeds pressure with what the next request holds: the reported call's input, its
output, and what was appended after the response (PostgreSQL and the embedded SQLite; the async
and sync clients, the sweep, and HTTP)."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import pytest

from compactd.scheduler.client import Client, CompactdClient
from compactd.storage.errors import InvalidMessage
from compactd.storage.store import Store
from compactd.worker.orchestration import compact
from compactd.worker.settings import Settings, build_config
from compactd.worker.sweeps import sweep_pressure
from tests.support.asgi import A, api_config, serve_app
from tests.support.enqueuer import RecordingEnqueuer
from tests.support.fake_provider import input_tokens_of, openai_request_body
from tests.support.scheduler_sessions import deps_for, make_config, text, user

TRIGGER = 10_000


def assistant(tokens: int) -> dict[str, Any]:
    return {"role": "assistant", "content": text(tokens)}


async def test_input_plus_output_fires_the_trigger(db_url: str, store: Store) -> None:
    """7500 input + 2501 output is over a 10,000-token trigger (LangChain counts the same)."""
    enqueuer = RecordingEnqueuer()
    async with CompactdClient(make_config(db_url, trigger=TRIGGER), store=store,
                              enqueuer=enqueuer) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.append([user(50)])
        info = await handle.report_usage(7500, 2499)
        await client.drain()
        assert info.reported_tokens == 9999 and enqueuer.sent == []
        info = await handle.report_usage(7500, 2501)
        await client.drain()
        assert (info.reported_input_tokens, info.reported_output_tokens) == (7500, 2501)
        assert [r.session_id for r in enqueuer.sent] == ["s1"]


async def test_a_report_over_the_trigger_with_a_live_mark_sends_nothing_more(
        db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a run is asked for (the mark the report's row shows is live), reports over the
    trigger neither enqueue again nor ask the store to mark: one round trip a step, not three.
    Once the mark is gone, the next report over the trigger marks and enqueues."""
    enqueuer = RecordingEnqueuer()
    marks: list[str] = []
    mark_signal = store.mark_signal

    async def counted(session_id: str, **kw: Any) -> bool:
        marks.append(session_id)
        return await mark_signal(session_id, **kw)

    monkeypatch.setattr(store, "mark_signal", counted)
    async with CompactdClient(make_config(db_url, trigger=TRIGGER), store=store,
                              enqueuer=enqueuer) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.append([user(50)])
        await handle.report_usage(7500, 2501)
        await client.drain()
        assert marks == ["s1"] and len(enqueuer.sent) == 1
        for i in range(5):
            info = await handle.report_usage(7500 + i, 2501)
            assert info.signal_at is not None
        await client.drain()
        assert marks == ["s1"] and len(enqueuer.sent) == 1
        await store.clear_signal("s1")
        await handle.report_usage(7600, 2501)
        await client.drain()
        assert marks == ["s1", "s1"] and len(enqueuer.sent) == 2


async def test_what_is_appended_after_the_response_counts_on_top(db_url: str,
                                                                 store: Store) -> None:
    enqueuer = RecordingEnqueuer()
    async with CompactdClient(make_config(db_url, trigger=TRIGGER), store=store,
                              enqueuer=enqueuer) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.append([user(50)])
        # Reported before the response is appended (the LangChain middleware's order): the
        # response, once appended, is already counted by the output tokens.
        await handle.report_usage(7500, 2000, response_appended=False)
        step = await handle.append([assistant(2000)])
        assert not step.fired and enqueuer.sent == []
        # Counted once: only compactd's few framing tokens of the message exceed the output.
        assert 9500 <= (await store.get_session("s1")).reported_tokens < 9510
        step = await handle.append([user(600)])  # a tool result after the response
        await client.drain()
        assert step.fired and [r.session_id for r in enqueuer.sent] == ["s1"]

        # Reported after the response is appended: everything appended later counts.
        other = await client.create_session("s2", run_model="gpt-4o")
        await other.append([user(50), assistant(2000)])
        await other.report_usage(7500, 2000)
        step = await other.append([user(600)])
        assert step.fired


async def test_the_sweep_counts_the_reported_output(db_url: str, store: Store) -> None:
    config = make_config(db_url, trigger=TRIGGER)
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.append([user(50)])
        await handle.report_usage(7500, 2501)
        grown = await client.create_session("s2", run_model="gpt-4o")
        await grown.append([user(50)])
        await grown.report_usage(7500, 2000)
        await grown.append([user(600)])
        quiet = await client.create_session("s3", run_model="gpt-4o")
        await quiet.append([user(50)])
        await quiet.report_usage(7500, 2000)
    for sid in ("s1", "s2"):
        await store.clear_signal(sid)  # as if the signals were lost
    result = await sweep_pressure(store, config, RecordingEnqueuer())
    assert sorted(result.enqueued) == ["s1", "s2"]


async def test_bad_usage_is_refused_and_changes_nothing(db_url: str, store: Store) -> None:
    async with CompactdClient(make_config(db_url), store=store,
                              enqueuer=RecordingEnqueuer()) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.report_usage(100, 10)
        for args, field in [((-1,), "input_tokens"), ((1, -1), "output_tokens"),
                            ((2**31,), "input_tokens"), ((1, 2**31), "output_tokens"),
                            ((1, True), "output_tokens"), ((2**30, 2**30), "output_tokens")]:
            with pytest.raises(InvalidMessage) as err:
                await handle.report_usage(*args)
            assert err.value.field == field
        info = await store.get_session("s1")
        assert (info.reported_input_tokens, info.reported_output_tokens) == (100, 10)


def test_the_sync_client_reports_output_tokens(db_url: str) -> None:
    with Client(make_config(db_url, trigger=TRIGGER)) as client:
        session = client.create_session("s1", run_model="gpt-4o")
        session.append([user(50)])
        info = session.report_usage(7500, 2501)
    assert info.reported_tokens == 10_001

    async def mark() -> Any:
        store = Store.from_url(db_url)
        try:
            return (await store.get_session("s1")).signal_at
        finally:
            await store.close()

    assert asyncio.run(mark()) is not None  # the report signalled a compaction


async def test_http_usage_takes_output_tokens(db_url: str, tmp_path: Any) -> None:
    config = api_config(db_url, tmp_path, summarization={
        "trigger": {"type": "tokens", "value": TRIGGER}, "keep": {"type": "messages", "value": 2}})
    async for api in serve_app(config):
        await api.create("s1", A, run_model="gpt-4o")
        await api.append("s1", A, {"role": "user", "content": "hello"})
        for body in ({"input_tokens": 1, "output_tokens": -1},
                     {"input_tokens": 1, "output_tokens": 2**31},
                     {"input_tokens": 1, "output_tokens": "many"},
                     {"input_tokens": 1, "response_appended": "perhaps"},
                     # Each within bounds, their sum not (what schemathesis found: a 503).
                     {"input_tokens": 2**31 - 1, "output_tokens": 2**31 - 1}):
            refused = await api.http.post("/v1/sessions/s1/usage", headers=A, json=body)
            assert refused.status_code == 422, (body, refused.text)
        usage = await api.http.post("/v1/sessions/s1/usage", headers=A,
                                    json={"input_tokens": 7500, "output_tokens": 2501})
        assert usage.status_code == 200, usage.text
        assert (usage.json()["reported_input_tokens"],
                usage.json()["reported_output_tokens"]) == (7500, 2501)
        signal = await api.http.post("/v1/sessions/s1/signal", headers=A)
        # The report itself signalled: a compaction is already queued.
        assert signal.json()["enqueued"] is False
        assert "already queued" in signal.json()["reason"]


async def test_a_report_older_than_a_compaction_is_not_recorded(db_url: str,
                                                                 store: Store) -> None:
    """The runtime built its call on the surface before a checkpoint landed and reports after:
    that count describes the larger request, not the next one. Recorded, it would fire the
    trigger on the small surface again (a run with nothing to do, or one the loop guard counts
    as a compaction without relief); it is not recorded, and no run is signalled."""
    config = make_config(db_url, trigger=TRIGGER)
    enqueuer = RecordingEnqueuer()
    async with CompactdClient(config, store=store, enqueuer=enqueuer) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        for _ in range(6):
            await handle.append([user(2000), assistant(50)])
        await handle.surface()  # the runtime's view: the call below is built on it
        built_on = handle.version
        await client.drain()
        enqueuer.sent.clear()
        outcome = await compact(deps_for(config, store), "s1", trigger="pressure")
        assert outcome.outcome == "committed", outcome
        compacted = await store.get_session("s1")
        assert compacted.surface_version > built_on and compacted.surface_tokens < TRIGGER
        await store.clear_signal("s1")  # the run is over: a new pressure would signal again

        info = await handle.report_usage(12_500, 300)  # the call made on the old surface
        await client.drain()
        assert info.reported_input_tokens is None and info.reported_tokens is None
        assert enqueuer.sent == []

        await handle.surface()  # the next call is built on the compacted surface
        info = await handle.report_usage(compacted.surface_tokens + 50, 300)
        assert info.reported_input_tokens == compacted.surface_tokens + 50
        assert info.reported_version == compacted.surface_version

        # Without the version (a runtime that cannot say), the report is recorded as before.
        info = await store.report_usage("s1", 12_500, 300, surface_version=None)
        assert info.reported_input_tokens == 12_500


async def test_a_surface_version_that_is_not_a_version_is_refused(db_url: str,
                                                                  store: Store) -> None:
    async with CompactdClient(make_config(db_url), store=store,
                              enqueuer=RecordingEnqueuer()) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.report_usage(100, 10)
        for bad in (-1, 2**63, True, "3"):
            with pytest.raises(InvalidMessage) as err:
                await store.report_usage("s1", 200, 20, surface_version=bad)  # type: ignore[arg-type]
            assert err.value.field == "surface_version"
        info = await store.get_session("s1")
        assert (info.reported_input_tokens, info.reported_output_tokens) == (100, 10)


async def test_http_usage_tagged_with_the_etag_counts_after_the_reply_and_not_after_a_compaction(
        db_url: str, tmp_path: Any, store: Store) -> None:
    """The documented flow: read the surface (its ETag), call the model, append the reply,
    report the usage tagged with the ETag. The append bumps the version, and the report is
    still the next request's measure; only a compaction committed after the ETag makes it
    stale."""
    config = api_config(db_url, tmp_path, summarization={
        "trigger": {"type": "tokens", "value": TRIGGER}, "keep": {"type": "messages", "value": 2}})
    async for api in serve_app(config):
        await api.create("s1", A, run_model="gpt-4o")
        for i in range(6):
            await api.append("s1", A, {"role": "user", "content": text(2000, f"q{i}")},
                             assistant(50))
        read = await api.http.get("/v1/sessions/s1/surface", headers=A)
        etag = int(read.headers["etag"].strip('W/"'))
        for bad in (-1, 2**63, "v3", 1.5):
            refused = await api.http.post("/v1/sessions/s1/usage", headers=A, json={
                "input_tokens": 10, "surface_version": bad})
            assert refused.status_code == 422, (bad, refused.text)
            assert refused.json()["field"] == "body.surface_version", refused.text
        reply = (await api.append("s1", A, assistant(40))).json()
        assert reply["version"] > etag
        fresh = await api.http.post("/v1/sessions/s1/usage", headers=A, json={
            "input_tokens": 9000, "output_tokens": 40, "response_appended": True,
            "surface_version": etag})
        assert fresh.status_code == 200, fresh.text
        assert fresh.json()["applied"] is True and fresh.json()["reported_input_tokens"] == 9000

        outcome = await compact(deps_for(config, store), "s1", trigger="manual", force=True)
        assert outcome.outcome == "committed", outcome
        stale = await api.http.post("/v1/sessions/s1/usage", headers=A, json={
            "input_tokens": 12_500, "output_tokens": 10, "surface_version": etag})
        assert stale.status_code == 200, stale.text
        assert stale.json()["applied"] is False
        assert stale.json()["reported_input_tokens"] is None  # the commit cleared the old one
        after = await api.http.get("/v1/sessions/s1/surface", headers=A)
        await api.append("s1", A, assistant(30))
        new = await api.http.post("/v1/sessions/s1/usage", headers=A, json={
            "input_tokens": 700, "output_tokens": 30,
            "surface_version": int(after.headers["etag"].strip('W/"'))})
        assert new.json()["applied"] is True and new.json()["reported_input_tokens"] == 700
        future = await api.http.post("/v1/sessions/s1/usage", headers=A, json={
            "input_tokens": 10, "surface_version": new.json()["version"] + 5})
        assert future.status_code == 422, future.text
        assert future.json()["field"] == "body.surface_version"
        assert "newer than the session's surface" in future.text
        assert (await store.get_session("s1")).reported_input_tokens == 700


async def test_a_report_counts_when_only_appends_came_after_its_view(db_url: str,
                                                                     store: Store) -> None:
    """Through the client: the version the call was built on, passed as the README says, or
    the handle's own view while another writer appended (a tool result stored by another
    process). Neither is older than a compaction, so both are recorded."""
    config = make_config(db_url, trigger=TRIGGER)
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        other = await client.get_session("s1")
        await handle.append([user(2000), assistant(50)])
        await handle.surface()
        built_on = handle.version
        await handle.append([assistant(40)])  # the reply
        info = await handle.report_usage(3000, 40, surface_version=built_on)
        assert (info.reported_input_tokens, info.reported_output_tokens) == (3000, 40)

        await handle.surface()
        await other.append([user(30)])  # another writer: the handle's view stays put
        info = await handle.report_usage(3100, 20)
        assert info.reported_input_tokens == 3100
        assert info.reported_tokens == 3100 + 20  # the other append is in the base already


async def test_the_kept_tail_is_the_keep_as_the_provider_counts_it(db_url: str,
                                                                    store: Store) -> None:
    """The runtime reports its provider's count of each request, which is larger than
    compactd's on short messages (the fake provider's rule: a quarter of the request body's
    bytes, its JSON framing included). The trigger fires on that count, and the keep is the
    provider's tokens too: the tail a checkpoint keeps, as the provider counts it, is at most
    the keep. Cut by compactd's smaller counts, the tail kept more, and every checkpoint left
    the session nearer its trigger than the policy says (the fleet's sessions were compacted
    again after a few hundred tokens of growth, and the loop guard cooled them down)."""
    trigger, keep = 3000, 1000
    raw = {"summarization": {"trigger": {"type": "tokens", "value": trigger},
                             "keep": {"type": "tokens", "value": keep}},
           "worker": {"metrics_port": 0}}
    config = build_config(raw, settings=Settings(database_url=db_url, broker_url="memory://"))

    def provider_count(messages: list[dict[str, Any]]) -> int:
        return input_tokens_of(openai_request_body("gpt-4o", messages))

    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        turn = 0
        while True:
            await handle.append([user(12, tag=f"q{turn}"), assistant(12)])
            turn += 1
            reported = provider_count(await handle.surface())
            info = await handle.report_usage(reported)
            if reported >= trigger:
                break
        counted = info.surface_tokens + info.envelope_tokens
        assert reported > counted * 1.2, (reported, counted)  # the two counters differ

        outcome = await compact(deps_for(config, store), "s1", trigger="pressure")
        assert outcome.outcome == "committed", outcome
        served = await handle.surface()
        at = max(i for i, m in enumerate(served) if (m.get("meta") or {}).get("checkpoint"))
        tail = served[at + 1:]
        assert tail, served
        assert provider_count(tail) - provider_count([]) <= keep


@pytest.mark.timed
async def test_a_usage_report_costs_the_runtime_less_cpu_than_its_append(clean_pg: str,
                                                                          ) -> None:
    """A runtime reports usage before nearly every step, in the agent's own process: the report
    is one statement, cheaper than the append of the shortest message (it was a transaction of
    three round trips built through SQLAlchemy, about 3x the append's CPU, and a fleet's agents
    fell behind their pace on it). PostgreSQL only: the embedded SQLite has no round trips."""
    calls = 200
    reports: list[float] = []
    appends: list[float] = []
    async with CompactdClient(make_config(clean_pg, trigger=TRIGGER),
                              enqueuer=RecordingEnqueuer()) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.append([user(5)])
        for i in range(calls + 20):
            started = time.process_time()
            await handle.report_usage(100 + i)
            reported = time.process_time()
            await handle.append([user(5, tag=f"m{i}")])
            appended = time.process_time()
            if i >= 20:  # the first calls prepare their statements
                reports.append(reported - started)
                appends.append(appended - reported)
        assert (await client.store.get_session("s1")).reported_input_tokens == 100 + calls + 19
    report_cpu, append_cpu = statistics.median(reports), statistics.median(appends)
    assert report_cpu < append_cpu, (f"report_usage {report_cpu * 1000:.3f} ms of CPU, "
                                     f"append {append_cpu * 1000:.3f} ms")
