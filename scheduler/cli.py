"""``compactd``: the operator's and the tests' way in.

Exit codes (``scheduler.output``): 0 success (including nothing_to_do), 1 a failed compaction (a
partial one too) or an operational error (a database or a broker that cannot be reached), 2 bad
input or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from compactd.scheduler import check, commands, deletion, leases
from compactd.scheduler.args import positive_int
from compactd.scheduler.output import (
    EXIT_BAD_INPUT,
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_OK,
    emit,
    open_store,
    redact_url,
    say,
)
from compactd.storage.errors import (
    BadInput,
    CompactdError,
    DatabaseMissing,
    InvalidMessage,
    SchemaMissing,
)
from compactd.storage.ids import check_id, check_session_id, check_tenant
from compactd.storage.messages import FORMATS, ToolLinks, read_jsonl
from compactd.storage.migrate import upgrade_async
from compactd.worker import logs
from compactd.worker.compaction.render import render_surface
from compactd.worker.enqueue import broker_errors
from compactd.worker.pressure import check_session_policy
from compactd.worker.settings import Config, load_config

Handler = Callable[[argparse.Namespace, Config], Coroutine[Any, Any, int]]


class UsageError(BadInput):
    """Bad command-line usage."""


# ------------------------------------------------------------------------------------------
# printing


def _preview(content: Any, width: int = 80) -> str:
    if isinstance(content, list):
        content = " ".join(str(b.get("text", f"[{b.get('type')}]")) for b in content)
    text = " ".join(str(content or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


# ------------------------------------------------------------------------------------------
# commands


async def cmd_migrate(args: argparse.Namespace, config: Config) -> int:
    await upgrade_async(config.database_url)
    say(f"migrated {redact_url(config.database_url)} to head")
    return EXIT_OK


async def cmd_ingest(args: argparse.Namespace, config: Config) -> int:
    path = Path(args.file)
    try:
        raw = await asyncio.to_thread(path.read_bytes)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    pairs = read_jsonl(raw.splitlines(), args.format)
    if not pairs:
        raise InvalidMessage(f"{path} holds no messages")
    lines = [line for line, _ in pairs]
    messages = [m for _, m in pairs]
    async with open_store(config) as store:
        existing = None
        with contextlib.suppress(CompactdError):
            existing = await store.get_session(args.session)
        if existing is None:
            # A new session has no earlier calls, so the batch alone decides its tool links;
            # checking before creating the session keeps a rejected file from leaving one behind.
            try:
                ToolLinks().check(messages)
            except InvalidMessage as exc:
                raise exc.at_line(lines[exc.index or 0]) from None
            check_session_policy(None, config, run_model=args.run_model,
                                 context_window=args.context_window)
        info = await store.create_session(
            args.session, tenant=args.tenant or (existing.tenant if existing else "default"),
            run_model=args.run_model if args.run_model is not None else (
                existing.run_model if existing else None),
            context_window=args.context_window or config.context_window(args.run_model))
        try:
            result = await store.append(
                info.id, messages, idempotency_key=args.idempotency_key,
                key_window_s=config.retention.append_key_window_s)
        except InvalidMessage as exc:
            if exc.index is not None:
                raise exc.at_line(lines[exc.index]) from None
            raise
    if args.json:
        emit({"session": info.id, "appended": len(messages), "first_seq": result.first_seq,
              "last_seq": result.last_seq, "version": result.version,
              "tokens": result.session.surface_tokens, "replayed": result.replayed})
    elif result.replayed:
        say(f"already ingested with this idempotency key: {len(messages)} messages in "
            f"{info.id} (seqs {result.first_seq}-{result.last_seq}); nothing stored now")
    else:
        say(f"ingested {len(messages)} messages into {info.id} (seqs {result.first_seq}-"
            f"{result.last_seq}); surface: {result.session.surface_messages} messages, "
            f"{result.session.surface_tokens} tokens")
    return EXIT_OK


async def cmd_surface(args: argparse.Namespace, config: Config) -> int:
    async with open_store(config, reads=args.session) as store:
        surface = await store.read_surface(args.session)
    messages = render_surface(surface.nodes, args.render)
    if args.json:
        emit({"session": surface.session_id, "version": surface.version,
              "tokens": surface.tokens, "messages": messages})
        return EXIT_OK
    say(f"session {surface.session_id}  version {surface.version}  "
        f"{len(surface.nodes)} nodes  {surface.tokens} tokens")
    say(f"{'seq':>6}  {'role':<9} {'tokens':>7}  content")
    for m in messages:
        tag = ""
        meta = m.get("meta") or {}
        if meta.get("checkpoint"):
            tag = "[checkpoint] "
        elif meta.get("pruned"):
            tag = "[pruned] "
        calls = m.get("tool_calls")
        body = _preview(m.get("content"))
        if calls:
            body = (body + " " if body else "") + "-> " + ", ".join(
                c["function"]["name"] for c in calls)
        say(f"{m['seq']:>6}  {m['role']:<9} {m.get('tokens', 0):>7}  {tag}{body}")
    say(f"total: {surface.tokens} tokens in {len(surface.nodes)} nodes")
    return EXIT_OK


async def cmd_verify(args: argparse.Namespace, config: Config) -> int:
    async with open_store(config, reads=None if args.all else args.session,
                          reads_all=args.all) as store:
        ids = await store.all_session_ids() if args.all else [args.session]
        results = [await store.verify(sid) for sid in ids]
    bad = [r for r in results if not r.ok]
    if args.json:
        emit({"ok": not bad, "sessions": len(results),
              "problems": {r.session_id: list(r.problems) for r in bad}})
    else:
        for r in results:
            if r.ok:
                say(f"ok   {r.session_id}: {r.nodes} nodes, {r.tokens} tokens")
            else:
                for p in r.problems:
                    say(f"FAIL {r.session_id}: {p}")
        say(f"{len(results) - len(bad)}/{len(results)} sessions verified")
    return EXIT_FAILED if bad else EXIT_OK


async def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    # Imported here for start-up time: the demo loads the whole worker pipeline, which no other
    # command of this module needs.
    from compactd.scheduler.demo import run_demo

    return await run_demo(config, steps=args.steps, as_json=args.json)


async def cmd_eval(args: argparse.Namespace, config: Config) -> int:
    # Imported here for start-up time: eval loads the replay pipeline, which no other command
    # of this module needs.
    from compactd.scheduler.evaluate import cmd_eval as evaluate

    return await evaluate(args, config)


# ------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compactd", description="Out-of-band context compaction for LLM agent runtimes.",
        epilog=EXIT_CODES_HELP)
    parser.add_argument("--config", help="YAML config file (default: $COMPACTD_CONFIG)")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {importlib.metadata.version('compactd')}",
                        help="print compactd's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="bring the database schema to the newest version")
    p.set_defaults(handler=cmd_migrate)

    p = sub.add_parser("ingest", help="append a JSON-lines transcript to a session")
    p.add_argument("file", help="the transcript: one JSON message per line")
    p.add_argument("--session", required=True,
                   help="the session to append to (created when new)")
    p.add_argument("--format", choices=FORMATS, default="openai",
                   help="the messages' shape (default openai)")
    p.add_argument("--run-model", help="the model the agent talks to (its tokenizer counts)")
    p.add_argument("--context-window", type=positive_int,
                   help="the run model's context window in tokens")
    p.add_argument("--tenant", help="the tenant the session belongs to (default: default)")
    p.add_argument("--idempotency-key", metavar="KEY",
                   help="run again with the same key and file (within "
                        "retention.append_keys_hours), the ingest stores nothing twice; "
                        "1-255 printable ASCII characters")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_ingest)

    p = sub.add_parser("surface", help="print what the model sees for a session")
    p.add_argument("session", help="the session id")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.add_argument("--render", choices=("durable_context", "compacted_summary", "langchain"),
                   help="how checkpoints are rendered (default: the configured render)")
    p.set_defaults(handler=cmd_surface)

    p = sub.add_parser("verify", help="replay the log and compare with the stored surface")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("session", nargs="?", help="the session id to verify")
    g.add_argument("--all", action="store_true", help="verify every session")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("demo", help="the embedded default, end to end")
    p.add_argument("--steps", type=positive_int, default=60,
                   help="agent steps in the generated session (default 60)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_demo)

    commands.register(sub)
    leases.register(sub)
    deletion.register(sub)
    check.register(sub)

    p = sub.add_parser("eval", help="replay transcripts through configurations and report what "
                                    "each keeps")
    p.add_argument("transcripts", nargs="+", metavar="TRANSCRIPT",
                   help="a JSON-lines transcript as ingest reads it, or a folder of *.jsonl")
    p.add_argument("--config", dest="eval_configs", action="append", required=True,
                   metavar="FILE", help="a configuration to evaluate (repeat to compare)")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="write report.json and index.html (charts) here")
    p.add_argument("--format", choices=FORMATS, default="openai",
                   help="the transcripts' message shape (default openai)")
    p.add_argument("--run-model", help="the model the agent talks to (its tokenizer counts)")
    p.add_argument("--context-window", type=positive_int,
                   help="the agent's context window in tokens (a fraction trigger's base)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=cmd_eval)
    return parser


def _check_ids(args: argparse.Namespace) -> None:
    """Refuse a session id, tenant or other name the HTTP API would refuse, before anything is
    opened (an argument that is not UTF-8 arrives here as lone surrogates)."""
    if getattr(args, "session", None) is not None:
        check_session_id(args.session, field="session")
    if getattr(args, "tenant", None) is not None:
        check_tenant(args.tenant, field="--tenant")
    for flag, what in (("run_model", "a run model"), ("run", "a run id"), ("by", "who"),
                       ("resume", "a bulk job id")):
        if getattr(args, flag, None) is not None:
            check_id(getattr(args, flag), field="--" + flag.replace("_", "-"), what=what)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_ids(args)
        config = load_config(path=args.config)
    except CompactdError as exc:
        sys.stderr.write(f"compactd: {exc}\n")
        return EXIT_BAD_INPUT
    logs.configure("text" if config.log_format == "auto" else config.log_format,
                   "WARNING" if config.log_level == "INFO" else config.log_level)
    handler: Handler = args.handler
    try:
        return asyncio.run(handler(args, config))
    except (SchemaMissing, DatabaseMissing) as exc:
        sys.stderr.write(f"compactd: {exc}\n")
        return EXIT_BAD_INPUT
    except BadInput as exc:
        sys.stderr.write(f"compactd: {exc}\n")
        return EXIT_BAD_INPUT
    except CompactdError as exc:
        sys.stderr.write(f"compactd: {exc}\n")
        return EXIT_FAILED
    except broker_errors() as exc:
        # An operational error, like a database that cannot be reached: one line naming the
        # broker (without its password), never kombu's traceback.
        sys.stderr.write(f"compactd: the broker cannot be reached at "
                         f"{redact_url(config.broker_url)}: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
