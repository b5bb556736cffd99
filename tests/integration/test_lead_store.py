"""The lead on both backends: the append copies its pool's lead onto the session row
(``compactd_append`` on PostgreSQL, the connector's statements on SQLite), and the signal the
append sets, the sweep's stored flag and its decision come out the same on both for the same
inputs; a lead of 0 is the rule from before the lead."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from compactd.storage.kinds import RunStatus
from compactd.storage.leads import ALL_POOLS, LeadRow
from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import Claim, RunEnd, utcnow
from compactd.storage.store import Store
from compactd.worker.compaction.lead import FIRST_LEAD_S
from compactd.worker.lead import refresh_leads
from compactd.worker.pressure import over_trigger, sweep_thresholds, wants_run
from compactd.worker.settings import Config, build_config


def words(n: int, i: int = 0) -> Message:
    return parse_openai({"role": "user", "content": " ".join(f"w{i}x{k}" for k in range(n))})


def config(trigger: int, lead: Any) -> Config:
    return build_config({"summarization": {
        "trigger": {"type": "tokens", "value": trigger},
        "keep": {"type": "messages", "value": 2}, "lead": lead}})


# (name, trigger, summarization.lead, the pools' measured leads: pool -> seconds)
CASES = [
    ("auto, the growth over its pool's lead reaches the trigger", 5_000, "auto",
     {"gpt-4o": 100.0}),
    ("auto, every pool's lead when its own has none", 5_000, "auto", {ALL_POOLS: 100.0}),
    ("auto, its own pool's lead before every pool's", 5_000, "auto",
     {"gpt-4o": 10.0, ALL_POOLS: 100.0}),
    ("auto, a short lead does not reach it", 5_000, "auto", {"gpt-4o": 10.0}),
    ("auto, nothing measured yet", 5_000, "auto", {}),
    ("lead 0, today's rule, whatever was measured", 5_000, 0, {"gpt-4o": 100.0}),
    ("configured", 5_000, 100, {}),
    ("over the trigger already", 3_000, 0, {}),
]


async def decide(store: Store, trigger: int, lead: Any, measured: dict[str, float]
                 ) -> dict[str, Any]:
    """Two appends ten seconds apart (a growth rate), then the sweep; what was decided."""
    c = config(trigger, lead)
    now = utcnow() - dt.timedelta(seconds=10)
    if measured:
        await store.store_leads([LeadRow(pool, s, "auto", 5, s, now)
                                 for pool, s in sorted(measured.items())])
    else:
        await refresh_leads(store, c)  # a configured lead is stored as it is; auto: no runs
    await store.create_session("s1", run_model="gpt-4o", now=now)
    await store.append("s1", [words(500)], now=now)
    second = await store.append("s1", [words(250, 1)], now=now + dt.timedelta(seconds=10),
                                signal_if=lambda info: wants_run(info, c))
    info = second.session
    await store.resolve_sweep_thresholds(key="k", resolve=lambda i: sweep_thresholds(i, c))
    await store.clear_signal("s1")
    chosen, _ = await store.select_for_sweep(decide=lambda i: over_trigger(i, c), limit=10,
                                             fresh_signal_s=0)
    flag = (await store.get_session("s1")).over_sweep
    return {"tokens": info.surface_tokens, "rate": round(info.growth_rate, 2),
            "lead_s": info.lead_s, "signalled": second.signalled, "over_sweep": bool(flag),
            "swept": [s.id for s in chosen]}


@pytest.mark.parametrize(("name", "trigger", "lead", "measured"), CASES,
                         ids=[c[0] for c in CASES])
async def test_sqlite_and_postgres_decide_the_same(clean_pg: str, sqlite_url: str, name: str,
                                                   trigger: int, lead: Any,
                                                   measured: dict[str, float]) -> None:
    results = {}
    for url in (sqlite_url, clean_pg):
        store = Store.from_url(url)
        try:
            results[url] = await decide(store, trigger, lead, measured)
        finally:
            await store.close()
    sqlite, postgres = results[sqlite_url], results[clean_pg]
    assert sqlite == postgres
    # About 3,000 tokens growing at about 23 a second: a lead of 100 s reaches 5,000, 10 s not.
    assert 2_500 < sqlite["tokens"] < 3_500 and 15 < sqlite["rate"] < 35
    fires = name.startswith(("auto, the growth", "auto, every", "configured", "over"))
    assert sqlite["signalled"] is fires, sqlite
    assert sqlite["swept"] == (["s1"] if fires else []), sqlite
    expected_lead = {"auto, its own pool's lead before every pool's": 10.0,
                     "auto, a short lead does not reach it": 10.0,
                     # the first lead, stored by the refresh, read by the append
                     "auto, nothing measured yet": FIRST_LEAD_S,
                     "over the trigger already": 0.0,
                     "lead 0, today's rule, whatever was measured": 100.0}.get(name, 100.0)
    assert sqlite["lead_s"] == expected_lead
    if fires:
        assert sqlite["over_sweep"]


async def test_the_stored_flag_holds_a_session_only_its_lead_fires(store: Store) -> None:
    # The partial index the sweep reads must hold a session under its trigger whose growth
    # over the lead reaches it; with a lead of 0 the flag is what it was.
    c = config(5_000, "auto")
    now = utcnow()
    await store.create_session("s1", run_model="gpt-4o", now=now)
    await store.append("s1", [words(500)], now=now)
    await store.append("s1", [words(250, 1)], now=now + dt.timedelta(seconds=10))
    await store.resolve_sweep_thresholds(key="k", resolve=lambda i: sweep_thresholds(i, c))
    assert not (await store.get_session("s1")).over_sweep
    await store.store_leads([LeadRow(ALL_POOLS, 100.0, "auto", 5, 100.0, now)])
    await store.append("s1", [words(1, 2)], now=now + dt.timedelta(seconds=11))
    assert (await store.get_session("s1")).over_sweep


async def test_the_measured_lead_is_the_signal_to_commit_time_of_summaries(
        store: Store) -> None:
    assert await store.lead_samples(since=utcnow() - dt.timedelta(hours=1), limit=10) == []
    rows = await refresh_leads(store, config(5_000, "auto"))
    # Nothing measured: every pool's lead is the first lead until a run is.
    assert [(r.pool, r.lead_s, r.source) for r in rows] == [(ALL_POOLS, FIRST_LEAD_S, "first")]
    assert (await store.read_leads([ALL_POOLS]))[ALL_POOLS].source == "first"
    rows = await refresh_leads(store, config(5_000, 7))
    assert [(r.pool, r.lead_s, r.source) for r in rows] == [(ALL_POOLS, 7.0, "configured")]
    assert (await store.read_leads([ALL_POOLS]))[ALL_POOLS].lead_s == 7.0
    # Back to auto with nothing measured: the configured row goes, the first lead is back.
    await refresh_leads(store, config(5_000, "auto"))
    assert (await store.read_leads([ALL_POOLS]))[ALL_POOLS].lead_s == FIRST_LEAD_S


async def _signalled_run(store: Store, session_id: str, outcome: str,
                         stages: dict[str, Any], *, ended_after_s: float) -> None:
    """A run of ``session_id`` signalled 2 s before its claim, ended ``ended_after_s`` after."""
    start = utcnow() - dt.timedelta(minutes=5)
    await store.create_session(session_id, run_model="gpt-4o")
    claim = await store.claim(session_id, owner="w", trigger="pressure", lease_s=600, now=start)
    assert isinstance(claim, Claim)
    assert await store.finish(session_id, run_id=claim.run_id, fence=claim.fence, end=RunEnd(
        outcome=outcome, model="gpt-4o", stages=stages,
        signalled_at=start - dt.timedelta(seconds=2)),
        now=start + dt.timedelta(seconds=ended_after_s))


async def test_a_run_s_first_checkpoint_is_a_lead_sample_timed_to_its_commit(
        store: Store) -> None:
    # A partial run committed a checkpoint 3 s after its claim, then failed 40 s later: the
    # agent waited 2 + 3 s for it, and that is what the lead learns, not the failure's time.
    # A committed run's first checkpoint, 4 s after its claim, is picked up before the later
    # rounds that end it at 8 s: 2 + 4 s.
    await _signalled_run(store, "committed", RunStatus.COMMITTED,
                         {"stages": ["summary"], "claim_to_commit_s": 4.0}, ended_after_s=8)
    # Written before runs recorded their first commit: timed to its end.
    await _signalled_run(store, "unstamped", RunStatus.COMMITTED,
                         {"stages": ["summary"]}, ended_after_s=9)
    await _signalled_run(store, "partial", RunStatus.PARTIAL,
                         {"stages": ["summary"], "claim_to_commit_s": 3.0}, ended_after_s=43)
    # Committed only prunes, or nothing: no checkpoint to time.
    await _signalled_run(store, "pruned", RunStatus.PARTIAL,
                         {"stages": ["prune"], "pruned": 2}, ended_after_s=20)
    await _signalled_run(store, "failed", RunStatus.FAILED,
                         {"stages": [], "claim_to_commit_s": 1.0}, ended_after_s=30)
    samples = await store.lead_samples(since=utcnow() - dt.timedelta(hours=1), limit=10)
    assert sorted((s.pool, round(s.seconds, 3)) for s in samples) == [
        ("gpt-4o", 5.0), ("gpt-4o", 6.0), ("gpt-4o", 11.0)]
    # The claim-to-commit time keep_at: pickup expects: the partial run's first checkpoint too.
    assert sorted(await store.claim_to_commit_durations(
        "gpt-4o", since=utcnow() - dt.timedelta(hours=1))) == [3.0, 4.0, 9.0]


async def test_the_claim_to_commit_times_of_both_statuses_are_one_statement(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read on every run's first read (keep_at: pickup): one round trip, not one per status.
    await _signalled_run(store, "committed", RunStatus.COMMITTED,
                         {"stages": ["summary"], "claim_to_commit_s": 4.0}, ended_after_s=8)
    await _signalled_run(store, "partial", RunStatus.PARTIAL,
                         {"stages": ["summary"], "claim_to_commit_s": 3.0}, ended_after_s=43)
    statements: list[str] = []
    fetch = store.db.fetch

    async def counted(name: str, **params: Any) -> Any:
        statements.append(name)
        return await fetch(name, **params)

    monkeypatch.setattr(store.db, "fetch", counted)
    assert await store.claim_to_commit_durations(
        "gpt-4o", since=utcnow() - dt.timedelta(hours=1)) == [3.0, 4.0]
    assert len(statements) == 1, statements
