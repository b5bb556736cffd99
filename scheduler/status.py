"""``compactd status``: recent runs, failures by class with the last error, live leases and
their age, loop-guard flags, bulk jobs. JSON for tools, a short report for people."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from compactd.storage.deletion import BeatRun
from compactd.storage.kinds import RunStatus
from compactd.storage.records import RunRecord, SessionInfo, utcnow
from compactd.storage.store import Store
from compactd.worker.cost import Price, total_usage, usage_cost
from compactd.worker.lead import lead_used
from compactd.worker.pressure import held_back, session_policy, session_pressure, waiting_why
from compactd.worker.retention import RETENTION_RUN
from compactd.worker.settings import Config
from compactd.worker.sweeps import least_runways

# Sessions ``compactd status`` lists by least runway.
RUNWAY_SHOWN = 10
# ``compactd status`` calls a session growing only if it appended within one growth window
# (storage.records.GROWTH_WINDOW_S): its rate decays after its last append but stays above zero,
# so minutes later an idle session still read as "growing".
GROWING_WINDOWS = 1.0
# Sessions ``compactd status`` lists by cost, and the newest runs that billed a provider it
# reads to rank them (``--since`` narrows them further).
COSTLIEST_SHOWN = 10
COST_RUNS_READ = 100_000


async def status(store: Store, *, since: dt.datetime | None = None,
                 config: Config | None = None) -> dict[str, Any]:
    now = utcnow()
    counts = await store.run_counts(since=since)
    # Failed and partial runs (committed some steps, then failed) by failure class.
    runs: dict[str, Any] = {RunStatus.COMMITTED: 0, RunStatus.NOTHING_TO_DO: 0,
                            RunStatus.RUNNING: 0, RunStatus.FAILED: {}, RunStatus.PARTIAL: {}}
    for (state, failure_class), n in counts.items():
        if state in (RunStatus.FAILED, RunStatus.PARTIAL):
            runs[state][failure_class or "unknown"] = runs[state].get(
                failure_class or "unknown", 0) + n
        else:
            runs[state] = runs.get(state, 0) + n
    last_errors = await store.last_errors(since=since)
    return {
        "runs": runs,
        "last_errors": {cls: _run_brief(run) for cls, run in sorted(last_errors.items())},
        "leases": [await _lease_of(store, info, now) for info in await store.live_leases(now=now)],
        "flagged": [_flag(info) for info in await store.flagged_sessions()],
        "bulk_jobs": [job.to_json() for job in await store.list_bulk_jobs()],
        "recent": [_run_brief(r) for r in await store.recent_runs(since=since, limit=10)],
        # Without a configuration no session's window is known (the CLI always has one).
        "runway": [r.to_json() for r in (await least_runways(
            store, config, now=now, idle_windows=GROWING_WINDOWS))[:RUNWAY_SHOWN]]
        if config is not None else [],
        "costliest": await costliest_sessions(
            store, config.prices if config is not None else {}, since=since),
        # When retention's purge last ran and what it removed (null: never).
        "retention": next((_beat_run(run) for run in await store.beat_runs([RETENTION_RUN])),
                          None),
    }


def _beat_run(run: BeatRun) -> dict[str, Any]:
    return {"last_run_at": run.finished_at.isoformat(),
            "age_s": _seconds(utcnow() - run.finished_at), "purged": run.result}


async def session_status(store: Store, session_id: str, *, limit: int = 20,
                         config: Config | None = None,
                         prices: Mapping[str, Price] | None = None,
                         lead_config: Config | None = None) -> dict[str, Any]:
    """One session's status; costs at ``prices`` (default: the configuration's); the lead it
    fires by under ``lead_config`` (default: ``config``), with why."""
    info = await store.get_session(session_id)
    now = utcnow()
    if prices is None:
        prices = config.prices if config is not None else {}
    body = {
        "session": info.id, "tenant": info.tenant, "run_model": info.run_model,
        "version": info.surface_version, "tokens": info.surface_tokens,
        "envelope_tokens": info.envelope_tokens, "messages": info.surface_messages,
        "lease": await _lease_of(store, info, now) if info.lease_run_id else None,
        "flagged": _flag(info) if info.flagged_reason else None,
        "runs": [{**_run_full(r), "cost": usage_cost(r.usage, prices)}
                 for r in await store.session_runs(session_id, limit=limit)],
        "cost": await session_cost(store, session_id, prices),
    }
    lead_config = lead_config or config
    if lead_config is not None:
        body["lead"] = (await lead_used(store, info, lead_config, now)).to_json()
    if config is not None:
        body["policy"] = _policy_of(info, config)
    if lead_config is not None:
        body["waiting_for_growth"] = _waiting_for_growth(info, lead_config)
    return body


def _waiting_for_growth(info: SessionInfo, config: Config) -> dict[str, Any] | None:
    """Whether a run found nothing worth a run yet (the session over its trigger, or fired
    early by its lead), so that no append, signal or sweep fires until it grows to
    ``until_tokens``; None when it is not waiting (``worker.pressure.held_back``)."""
    policy = session_policy(info, config)
    pressure = session_pressure(info, policy)
    if not held_back(info, pressure):
        return None
    return {"until_tokens": info.refire_tokens, "tokens": pressure.tokens,
            "why": waiting_why(pressure, policy)}


async def session_cost(store: Store, session_id: str, prices: Mapping[str, Price]
                       ) -> dict[str, Any]:
    """What every run of the session cost (not only the runs listed)."""
    usages = [usage for _, usage in await store.run_usages(session_id=session_id)]
    return {**usage_cost(total_usage(usages), prices), "billed_runs": len(usages)}


async def costliest_sessions(store: Store, prices: Mapping[str, Price], *,
                             since: dt.datetime | None = None) -> list[dict[str, Any]]:
    """The sessions whose runs cost most, over the newest ``COST_RUNS_READ`` runs that billed a
    provider (since ``since``). A session with a run of an unpriced candidate has no total; it
    is listed after the priced ones, by its billed tokens."""
    by_session: dict[str, list[dict[str, Any]]] = {}
    for session_id, usage in await store.run_usages(since=since, limit=COST_RUNS_READ):
        by_session.setdefault(session_id, []).append(usage)
    ranked = []
    for session_id, usages in by_session.items():
        total = total_usage(usages)
        cost = usage_cost(total, prices)
        ranked.append({"session": session_id, **cost, "billed_runs": len(usages),
                       "input_tokens": total["input_tokens"],
                       "output_tokens": total["output_tokens"]})
    ranked.sort(key=lambda c: (c["usd"] is not None, c["usd"] or 0.0,
                               c["input_tokens"] + c["output_tokens"]), reverse=True)
    return ranked[:COSTLIEST_SHOWN]


def render_costliest(costliest: list[dict[str, Any]]) -> list[str]:
    lines = [f"costliest sessions (summary calls at the configured prices): {len(costliest)}"]
    for c in costliest:
        usd = f"${c['usd']:.4f}" if c["usd"] is not None else f"unpriced ({c['basis']})"
        lines.append(f"  {c['session']}: {usd} over {c['billed_runs']} runs, "
                     f"{c['input_tokens']} input / {c['output_tokens']} output tokens")
    return lines


def _render_cost(cost: dict[str, Any] | None) -> str:
    if not cost:
        return ""
    return f"${cost['usd']:.4f}" if cost["usd"] is not None else "unpriced"


def _policy_of(info: SessionInfo, config: Config) -> dict[str, Any]:
    """The trigger this session runs under, with what its window made the policy drop (a
    fraction-only trigger without a window means no automatic compaction at all)."""
    policy = session_policy(info, config)
    return {"auto": policy.auto, "context_window": policy.context_window,
            "trigger": [" and ".join(c.describe() for c in group) for group in policy.trigger],
            "warnings": list(policy.warnings())}


async def _lease_of(store: Store, info: SessionInfo, now: dt.datetime) -> dict[str, Any]:
    run = await store.get_run(info.lease_run_id) if info.lease_run_id else None
    return _lease(info, now, run)


def _lease(info: SessionInfo, now: dt.datetime, run: RunRecord | None = None) -> dict[str, Any]:
    """A lease, with how long its run has held it (``age_s``) and since its holder last renewed
    it (``heartbeat_age_s``): a lease renewed recently but very old is a stuck run, one not
    renewed for a while is a dead holder the reaper will end."""
    expires = info.lease_expires_at
    heartbeat = run.heartbeat_at if run else None
    return {"session": info.id, "owner": info.lease_owner, "run_id": info.lease_run_id,
            "fence": info.lease_fence,
            "trigger": run.trigger if run else None,
            "task_id": run.task_id if run else None,
            "started_at": run.started_at.isoformat() if run else None,
            "age_s": _seconds(now - run.started_at) if run else None,
            "heartbeat_age_s": _seconds(now - heartbeat) if heartbeat else None,
            "expires_at": expires.isoformat() if expires else None,
            "expires_in_s": _seconds(expires - now) if expires else None,
            "expired": bool(expires and expires <= now)}


def _seconds(delta: dt.timedelta) -> float:
    return round(delta.total_seconds(), 1)


def _flag(info: SessionInfo) -> dict[str, Any]:
    return {"session": info.id, "reason": info.flagged_reason,
            "flagged_at": info.flagged_at.isoformat() if info.flagged_at else None,
            "cooldown_until": info.cooldown_until.isoformat() if info.cooldown_until else None}


def _run_brief(run: RunRecord) -> dict[str, Any]:
    return {"run_id": run.id, "session": run.session_id, "trigger": run.trigger,
            "status": run.status, "failure_class": run.failure_class, "error": run.error,
            "started_at": run.started_at.isoformat(),
            "age_s": round((utcnow() - run.started_at).total_seconds(), 1)}


def _run_full(run: RunRecord) -> dict[str, Any]:
    failures = [c for c in run.candidates or () if c.get("kind")]
    return {**_run_brief(run), "tokens_before": run.tokens_before,
            "tokens_after": run.tokens_after, "model": run.model, "usage": run.usage,
            "finished_at": run.finished_at.isoformat() if run.finished_at else None,
            "candidates": failures,
            "stages": (run.stages or {}).get("stages", []) if run.stages else [],
            # What the run expected to arrive before its pickup (keep_at: pickup).
            "arrivals": (run.stages or {}).get("arrivals"),
            # What a manual run was asked to focus on.
            "instructions": run.instructions or []}


def render_status(body: dict[str, Any]) -> str:
    """One session's status (``status --session``), else the fleet's, as text."""
    lines = _session_lines(body) if "session" in body else _fleet_lines(body)
    return "\n".join(lines) + "\n"


def _session_lines(body: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines.append(f"session {body['session']}: version {body['version']}, {body['tokens']} "
                 f"tokens in {body['messages']} nodes (+{body['envelope_tokens']} envelope)")
    if body["lease"]:
        lines.append(f"  leased: {_render_lease(body['lease'])}")
    if body["flagged"]:
        lines.append(f"  FLAGGED: {body['flagged']['reason']}")
    if body.get("lead"):
        lines.append(f"  lead: {body['lead']['seconds']:g} s ({body['lead']['why']})")
    if waiting := body.get("waiting_for_growth"):
        lines.append(f"  waiting for growth: {waiting['tokens']} tokens, fires again at "
                     f"{waiting['until_tokens']} ({waiting['why']})")
    for warning in (body.get("policy") or {}).get("warnings", ()):
        lines.append(f"  WARNING: {warning}")
    if body.get("cost"):
        lines.append(f"  cost: {_render_cost(body['cost'])} over "
                     f"{body['cost']['billed_runs']} runs that billed a provider "
                     f"({body['cost']['basis']})")
    for run in body["runs"]:
        what = run["status"] + (f" ({run['failure_class']})" if run["failure_class"] else "")
        lines.append(f"  {run['started_at'][:19]}  {run['trigger']:<8} {what:<24} "
                     f"{run['tokens_before'] or ''}->{run['tokens_after'] or ''}  "
                     f"{_render_cost(run.get('cost'))}".rstrip())
        for c in run["candidates"]:
            lines.append(f"      {c['candidate']}: {c['kind']} - {c['reason']}")
    return lines


def _fleet_lines(body: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    runs = body["runs"]
    failed = runs[RunStatus.FAILED]
    partial = runs.get(RunStatus.PARTIAL, {})
    lines.append(f"runs: {runs[RunStatus.COMMITTED]} committed, "
                 f"{runs[RunStatus.NOTHING_TO_DO]} nothing to do, "
                 f"{sum(failed.values())} failed, {sum(partial.values())} partial, "
                 f"{runs.get(RunStatus.RUNNING, 0)} running")
    by_class = {cls: failed.get(cls, 0) + partial.get(cls, 0) for cls in {*failed, *partial}}
    for cls, n in sorted(by_class.items(), key=lambda kv: -kv[1]):
        last = body["last_errors"].get(cls)
        lines.append(f"  {cls:<12} {n:>6}   last: {(last or {}).get('error') or ''}"[:160])
    lines.append(f"leases: {len(body['leases'])}")
    for lease in body["leases"]:
        lines.append(f"  {lease['session']}: {_render_lease(lease)}")
    lines.append(f"flagged (loop guard): {len(body['flagged'])}")
    for flag in body["flagged"]:
        lines.append(f"  {flag['session']}: {flag['reason']}")
    lines.append(f"bulk jobs: {len(body['bulk_jobs'])}")
    for job in body["bulk_jobs"]:
        lines.append(f"  {job['id']} {job['state']}: {job['done']}/{job['matched']} done, "
                     f"{job['skipped']} skipped (nothing to do), {job['failed']} failed")
    lines.append(f"growing sessions: {len(body.get('runway', ()))} (least runway first: the "
                 f"time before the window at the current growth)")
    for r in body.get("runway", ()):
        lines.append(f"  {r['session']}: runway {r['runway_s']:g} s, {r['tokens']}/{r['window']} "
                     f"tokens, growing {r['rate_per_s']:g} tokens/s")
    lines.extend(render_costliest(body.get("costliest", [])))
    retention = body.get("retention")
    if retention is None:
        lines.append("retention: never ran")
    else:
        purged = retention["purged"]
        lines.append(f"retention: last ran {retention['last_run_at'][:19]} "
                     f"({retention['age_s']:g} s ago), purged {purged.get('originals', 0)} "
                     f"originals and {purged.get('sessions', 0)} idle sessions")
    lines.append(f"recent runs: {len(body['recent'])}")
    for run in body["recent"]:
        what = run["status"] + (f" ({run['failure_class']})" if run["failure_class"] else "")
        lines.append(f"  {run['started_at'][:19]}  {run['session']:<20} {run['trigger']:<8} "
                     f"{what}")
    return lines


def _render_lease(lease: dict[str, Any]) -> str:
    text = f"run {lease['run_id']} by {lease['owner']}"
    if lease.get("age_s") is not None:
        text += f", held {lease['age_s']:g} s"
    if lease.get("heartbeat_age_s") is not None:
        text += f", renewed {lease['heartbeat_age_s']:g} s ago"
    if lease["expired"]:
        return text + f", EXPIRED at {lease['expires_at']} (the reaper will end it)"
    return text + f", expires in {lease.get('expires_in_s')} s"
