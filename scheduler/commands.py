"""CLI commands beyond the foundation's: plan, compact, signal, status, recompact, serve, and
recall (history search, history read, tools).

What only some commands need (the planner, the client and its enqueuing, the status report) is
imported in their handlers: every ``compactd`` process imports this module to build its parser,
and most run one of the foundation's commands (tests/unit/test_cli_startup.py holds the line)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import uuid
from typing import Any

from compactd.scheduler.args import (
    count,
    duration,
    parse_duration,
    parse_keep,
    port,
    positive_int,
    seconds,
    whole,
)
from compactd.scheduler.intake import parse_signal
from compactd.scheduler.output import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_OK,
    emit,
    open_store,
    say,
)
from compactd.storage.errors import InvalidMessage, RecallArgumentError
from compactd.storage.instructions import MAX_INSTRUCTION_CHARS, check_instructions
from compactd.storage.kinds import RunCause, RunStatus, SignalReason
from compactd.storage.recall_bounds import (
    DEFAULT_READ_TOKENS,
    DEFAULT_SEARCH_LIMIT,
    MAX_READ_TOKENS,
    MAX_SEARCH_LIMIT,
    MIN_READ_TOKENS,
)
from compactd.storage.records import utcnow
from compactd.worker.cost import usage_cost
from compactd.worker.limits import parse_rate
from compactd.worker.pressure import ahead_tokens, session_policy
from compactd.worker.settings import Config

KEEP_HELP = "messages:N | tokens:N | fraction:F (overrides the policy's keep for this run)"
COMPACT_WAIT_S = 120.0


# ------------------------------------------------------------------------------------------
# plan


async def cmd_plan(args: argparse.Namespace, config: Config) -> int:
    from compactd.worker.compaction.planner import Outlook, plan
    from compactd.worker.pickup import predict_arrivals

    keep = parse_keep(args.keep)
    async with open_store(config, reads=args.session) as store:
        info = await store.get_session(args.session)
        surface = await store.read_surface(args.session)
        policy = session_policy(info, config)
        now = utcnow()
        # What a worker's run would expect to arrive before its pickup (keep_at: pickup).
        arrivals = (None if keep is not None or args.force else
                    await predict_arrivals(store, config, info, policy, surface.nodes, now))
    result = plan(surface.nodes, policy=policy, envelope_tokens=info.envelope_tokens,
                  reported_input_tokens=info.reported_tokens, run_model=info.run_model,
                  now=now, force=args.force, keep_override=keep, envelope=info.envelope,
                  outlook=Outlook(lead_tokens=ahead_tokens(info, policy, config),
                                  arrivals=arrivals, edits_may_wait=not args.force,
                                  last_append_at=info.last_append_at))
    body = {"session": info.id, "surface_version": surface.version, **result.to_json()}
    if args.json:
        emit(body)
        return 0
    p = result.pressure
    say(f"session {info.id} (version {surface.version}): {p.tokens} tokens, {p.messages} "
        f"messages" + (f", {p.fraction:.1%} of the window" if p.fraction is not None else ""))
    say(f"trigger: {'fired' if result.fired else 'not fired'} - {result.reason}"
        + (" (forced)" if args.force else ""))
    if arrivals is not None:
        pace = (f"an append every {arrivals.cadence.interval_s:.2f} s"
                if arrivals.cadence is not None
                else f"{arrivals.rate_tokens_per_s:.1f} tokens/s")
        say(f"keep_at pickup: {arrivals.messages} messages ({arrivals.tokens} tokens) expected "
            f"before the pickup ({pace} for {arrivals.seconds:.1f} s, then a step of "
            f"{arrivals.pickup_step.messages:.1f} messages); the kept tail is smaller by them")
    if result.prune:
        saved = sum(a.tokens_before - a.tokens_after for a in result.prune)
        say(f"prune: {len(result.prune)} tool results, saving {saved} tokens "
            f"-> {result.tokens_after_prune} tokens")
    step = result.summarize
    layout = result.recall_pass
    if layout is not None:
        say(f"recallable pass ({layout.mode}): replace {len(layout.replace_seqs)} nodes "
            f"({layout.replaced_tokens} tokens), keep {len(layout.keep_seqs)}")
        if layout.rollup is not None:
            say(f"  roll up {layout.rollup.rolled_up} index checkpoints into "
                f"{layout.rollup.ref}")
        for chunk in layout.chunks:
            say(f"  index {chunk.ref}: {len(chunk.replace_seqs)} nodes "
                f"({chunk.replaced_tokens} tokens) in {len(chunk.calls)} call(s)")
        say(f"  state {layout.state.ref}: {len(layout.state.calls)} call(s), under "
            f"{layout.state.room_tokens} tokens")
    elif step is None:
        say(f"summarize: no ({result.why_no_summary or result.nothing_to_do})")
    else:
        say(f"summarize: replace {len(step.replace_seqs)} nodes ({step.replaced_tokens} tokens) "
            f"in {len(step.calls)} call(s), keep {len(step.keep_seqs)}")
        for call in step.calls:
            say(f"  call {call.index + 1}: seqs {call.seqs[0]}..{call.seqs[-1]} "
                f"({len(call.seqs)}), ~{call.input_tokens} input tokens")
    return 0


# ------------------------------------------------------------------------------------------
# compact


async def cmd_compact(args: argparse.Namespace, config: Config) -> int:
    keep = parse_keep(args.keep)
    keep_text = None if keep is None else keep.to_text()
    # Checked before anything is opened: over the bound is bad input, exit 2.
    focus = None if args.instructions is None else check_instructions(args.instructions)
    if args.timeout is not None and not args.wait:
        raise InvalidMessage("only --wait waits for the run; without it nothing would use "
                             "the timeout", field="--timeout")
    if args.inline:
        # Imported here for start-up time: only --inline runs the worker's pipeline.
        from compactd.worker.orchestration import compact
        from compactd.worker.runtime import open_deps

        async with open_deps(config, owner=f"cli:{uuid.uuid4().hex[:8]}") as deps:
            await deps.store.get_session(args.session)
            outcome = await compact(deps, args.session, trigger=RunCause.MANUAL, force=args.force,
                                    keep=keep, instructions=() if focus is None else (focus,))
        result = {**outcome.to_json(), "cost": usage_cost(outcome.usage, config.prices)}
    else:
        from compactd.scheduler.client import CompactdClient

        async with CompactdClient(config) as client:
            handle = await client.get_session(args.session)
            result = await handle.compact(force=args.force, keep=keep_text, wait=args.wait,
                                          timeout_s=args.timeout or COMPACT_WAIT_S,
                                          instructions=focus)
    if args.json:
        emit(result)
    elif result.get("outcome") == "queued":
        say(("already queued (not started yet) as task " if result.get("coalesced")
             else "queued on compaction.urgent as task ")
            + f"{result['task_id']} (compactd status {args.session} shows its run)")
    else:
        _say_outcome(result)
    return _COMPACT_EXITS.get(result.get("outcome"), EXIT_OK)


# DESIGN.md's contract has one status for a failed compaction: a partial run is one (status
# counts it so); the outcome it prints, "partial", says its commits stay.
_COMPACT_EXITS: dict[str | None, int] = {RunStatus.FAILED: EXIT_FAILED,
                                        RunStatus.PARTIAL: EXIT_FAILED}


def _say_outcome(result: dict[str, Any]) -> None:
    outcome = result["outcome"]
    if outcome == RunStatus.PARTIAL:
        say(f"partial ({result['failure_class']}): {result.get('error')}; "
            f"{result.get('tokens_before')} -> {result.get('tokens_after')} tokens")
        return
    if outcome == RunStatus.FAILED:
        say(f"failed ({result['failure_class']}): {result.get('error')}")
        for c in result.get("candidates") or ():
            if c.get("kind"):
                say(f"  {c['candidate']}: {c['kind']} - {c['reason']}")
        return
    say(f"{outcome}: {result.get('tokens_before')} -> {result.get('tokens_after')} tokens"
        + (f"; stages {', '.join(result['stages'])}" if result.get("stages") else "")
        + (f"; model {result['model']}" if result.get("model") else ""))
    if outcome == RunStatus.NOTHING_TO_DO and result.get("error"):
        say(f"  {result['error']}")


# ------------------------------------------------------------------------------------------
# signal


async def cmd_signal(args: argparse.Namespace, config: Config) -> int:
    # Validated before anything is opened: a bad field is bad input whatever the database says.
    payload = parse_signal({"session": args.session, "reason": args.reason})
    from compactd.scheduler.client import CompactdClient

    async with CompactdClient(config) as client:
        handle = await client.get_session(payload.session)
        result = await handle.signal(payload.reason)
    if args.json:
        emit(result.to_json())
    else:
        say(("enqueued: " if result.enqueued else "not enqueued: ") + result.reason)
    return 0


# ------------------------------------------------------------------------------------------
# status


async def cmd_status(args: argparse.Namespace, config: Config) -> int:
    from compactd.scheduler.status import render_status, session_status, status

    async with open_store(config, reads=args.session, reads_all=not args.session) as store:
        if args.session:
            body = await session_status(store, args.session, limit=args.limit, config=config)
        else:
            body = await status(store, since=_since(args.since), config=config)
    if args.json:
        emit(body)
    else:
        sys.stdout.write(render_status(body))
    return 0


def _since(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    return utcnow() - dt.timedelta(seconds=parse_duration(text))


# ------------------------------------------------------------------------------------------
# recompact


async def cmd_recompact(args: argparse.Namespace, config: Config) -> int:
    # Imported here for start-up time: the bulk fan-out loads Celery's app.
    from compactd.scheduler.bulk import BulkFilter, run_recompact


    try:
        rate = parse_rate(args.rate) if args.rate else None
    except ValueError as exc:
        raise InvalidMessage(str(exc), field="rate") from None
    bulk_filter = BulkFilter.from_args(args)
    return await run_recompact(config, bulk_filter, force=args.force, dry_run=args.dry_run,
                               rate_per_s=rate, resume=args.resume, as_json=args.json,
                               chunk=args.chunk, wait=not args.no_wait,
                               timeout_s=args.timeout)


# ------------------------------------------------------------------------------------------
# serve


async def cmd_serve(args: argparse.Namespace, config: Config) -> int:
    # Imported here for start-up time: FastAPI and uvicorn load only for the server.
    from compactd.scheduler.http import serve

    await serve(config, host=args.host, port=args.port)
    return 0


# ------------------------------------------------------------------------------------------
# recall


class RecallUsage(InvalidMessage):
    """A recall argument refused, named as the command line spells it."""


# storage names its arguments as the tools do; the command line spells some otherwise
_CLI_NAMES = {"query": "QUERY", "checkpoint": "--checkpoint", "limit": "--limit",
              "offset": "--offset", "cursor": "--cursor", "budget_tokens": "--budget-tokens"}


def _recall_refused(exc: RecallArgumentError, names: dict[str, str]) -> RecallUsage:
    return RecallUsage(f"{names.get(exc.argument, exc.argument)}: {exc.reason}")


async def cmd_history_search(args: argparse.Namespace, config: Config) -> int:
    # Imported here for start-up time: only the recall commands check its arguments.
    from compactd.worker.compaction.recall_tools import check_search

    try:
        # Checked before anything is opened: bad input writes nothing, not even a new file.
        checked = check_search(args.query, args.checkpoint, args.limit)
        ref = None if checked.checkpoint is None else str(checked.checkpoint)
        async with open_store(config, reads=args.session) as store:
            result = await store.history_search(args.session, checked.query, ref,
                                                checked.limit)
    except RecallArgumentError as exc:
        raise _recall_refused(exc, _CLI_NAMES) from None
    if args.json:
        emit({"session": args.session, **result.to_json()})
        return 0
    for hit in result.hits:
        snippet = " ".join(hit.snippet.split())
        say(f"{hit.checkpoint}  seq {hit.seq}  {'exact' if hit.exact else 'fuzzy'}  {snippet}")
    say(f"{len(result.hits)} hit(s); scanned {result.scanned_messages} replaced message(s), "
        f"{result.scanned_bytes} bytes")
    return 0


async def cmd_history_read(args: argparse.Namespace, config: Config) -> int:
    from compactd.worker.compaction.recall_tools import check_read

    try:
        checked = check_read(args.checkpoint, args.offset, args.cursor, args.budget_tokens)
        ref = str(checked.checkpoint)
        async with open_store(config, reads=args.session) as store:
            page = await store.history_read(args.session, ref, checked.offset,
                                            cursor=checked.cursor,
                                            budget_tokens=checked.budget_tokens)
    except RecallArgumentError as exc:
        raise _recall_refused(exc, {**_CLI_NAMES, "checkpoint": "CHECKPOINT"}) from None
    if args.json:
        emit({"session": args.session, **page.to_json()})
        return 0
    sys.stdout.write(page.transcript if page.transcript.endswith("\n") or not page.transcript
                     else page.transcript + "\n")
    if page.cursor is not None:
        budget = ("" if checked.budget_tokens == DEFAULT_READ_TOKENS
                  else f" --budget-tokens {checked.budget_tokens}")
        say(f"-- more: compactd history read {args.session} {ref} --cursor {page.cursor}"
            f"{budget}")
    return 0


async def cmd_tools(args: argparse.Namespace, config: Config) -> int:
    from compactd.worker.compaction.recall_tools import tools_document

    document = tools_document()
    if args.json:
        emit(document)
        return 0
    for tool in document["openai"]:
        function = tool["function"]
        say(f"{function['name']}: {function['description']}")
    return 0


def _register_recall(sub: Any) -> None:
    history = sub.add_parser("history", help="recall what compaction replaced in a session")
    verbs = history.add_subparsers(dest="history_command", required=True, metavar="COMMAND")
    p = verbs.add_parser("search", help="search the originals compaction replaced")
    p.add_argument("session", help="the session id")
    p.add_argument("query", help="an error line, an id, a path, words (exact matches first)")
    p.add_argument("--checkpoint", help="only what this checkpoint or pruned result replaced")
    p.add_argument("--limit", type=whole(1, MAX_SEARCH_LIMIT), default=DEFAULT_SEARCH_LIMIT,
                   help=f"at most this many hits (1-{MAX_SEARCH_LIMIT}, default "
                        f"{DEFAULT_SEARCH_LIMIT})")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_history_search)

    p = verbs.add_parser("read", help="read a checkpoint's or pruned result's originals, paged")
    p.add_argument("session", help="the session id")
    p.add_argument("checkpoint", help="a checkpoint's or a pruned result's name (c12-340, r57)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--offset", type=count, default=0,
                       help="the message index to start at (default 0)")
    where.add_argument("--cursor", help="the cursor the previous page printed")
    p.add_argument("--budget-tokens", type=whole(MIN_READ_TOKENS, MAX_READ_TOKENS),
                   default=DEFAULT_READ_TOKENS,
                   help=f"most tokens on the page ({MIN_READ_TOKENS}-{MAX_READ_TOKENS}, "
                        f"default {DEFAULT_READ_TOKENS})")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_history_read)

    p = sub.add_parser("tools", help="the recall tools' schemas for a runtime's model")
    p.add_argument("--json", action="store_true",
                   help="both forms, OpenAI and Anthropic, as GET /v1/tools serves them")
    p.set_defaults(handler=cmd_tools)


def register(sub: Any) -> None:
    """Add the compaction, scheduling and operations commands to ``sub``."""
    p = sub.add_parser("plan", help="dry run: what a compaction would do (writes nothing)")
    p.add_argument("session", help="the session id")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.add_argument("--force", action="store_true", help="ignore the trigger and keep policy")
    p.add_argument("--keep", help=KEEP_HELP)
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("compact", help="compact a session now", epilog=EXIT_CODES_HELP)
    p.add_argument("session", help="the session id")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.add_argument("--force", action="store_true", help="ignore the trigger and keep policy")
    p.add_argument("--keep", help=KEEP_HELP)
    p.add_argument("--instructions", metavar="TEXT",
                   help="what the summary should focus on for this run (at most "
                        f"{MAX_INSTRUCTION_CHARS} characters)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--inline", action="store_true",
                     help="run the pipeline in this process (same lease protocol)")
    how.add_argument("--wait", action="store_true",
                     help="enqueue on compaction.urgent and wait for the run's result")
    p.add_argument("--timeout", type=seconds,
                   help=f"seconds --wait waits (default {COMPACT_WAIT_S:g})")
    p.set_defaults(handler=cmd_compact)

    p = sub.add_parser("signal", help="send a pressure signal for a session")
    p.add_argument("session", help="the session id")
    p.add_argument("--reason", default=SignalReason.PRESSURE,
                   choices=[r.value for r in SignalReason], help=" | ".join(SignalReason))
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_signal)

    p = sub.add_parser("status", help="runs, failures, leases, loop-guard flags, bulk jobs")
    p.add_argument("session", nargs="?", help="one session's runs and state (default: all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.add_argument("--since", type=duration, help="only runs newer than this (e.g. 1h, 30m)")
    p.add_argument("--limit", type=positive_int, default=20,
                   help="at most this many runs and sessions per list (default 20)")
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser("recompact", help="bulk recompaction of many sessions")
    p.add_argument("--tenant", help="only this tenant's sessions")
    p.add_argument("--run-model", help="only sessions of this run model")
    p.add_argument("--min-tokens", type=count, help="only sessions with at least this many tokens")
    p.add_argument("--idle-for", type=duration,
                   help="only sessions without appends for this long (e.g. 1h)")
    p.add_argument("--session-file", help="a file of session ids, one per line")
    p.add_argument("--force", action="store_true",
                   help="compact each session even under its trigger")
    p.add_argument("--dry-run", action="store_true",
                   help="list the sessions the filters select; enqueue nothing")
    p.add_argument("--rate", help="model calls per second across all workers, e.g. 20/s")
    p.add_argument("--resume", metavar="JOB", help="continue a bulk job")
    p.add_argument("--chunk", type=positive_int, default=100, help="sessions enqueued per chunk")
    p.add_argument("--no-wait", action="store_true",
                   help="return once every session is enqueued")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="give up waiting when no session of the job finished for S seconds "
                        "(default 300; the job stays and --resume continues it)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_recompact)

    p = sub.add_parser("serve", help="the HTTP API for runtimes in any language")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8080, help="port to listen on (default 8080)")
    p.set_defaults(handler=cmd_serve)

    _register_recall(sub)

