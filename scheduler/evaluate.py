"""``compactd eval``: what a configuration keeps, measured on the user's own transcripts.

    compactd eval TRANSCRIPT_OR_DIR... --config A.yaml [--config B.yaml ...] [--report DIR]

Every transcript (a JSON-lines file as ``compactd ingest`` reads it, or a folder of them) is
replayed through the pipeline each configuration sets up (``worker.replay``: inline, its
models, its policy), each configuration on its own temporary embedded store (a SQLite file in a
temporary directory, deleted after), never the configured database. Every input is read and
checked before anything runs: a transcript that is not valid JSON lines, or a configuration that
does not load, is bad input (exit 2) naming the file and the line or key.

Reported per configuration, side by side: coverage, compression, summarizer calls and their
input tokens, the providers' usage and its cost at the configuration's ``prices:``, and the
retention of probes (``worker.probes``) extracted from every range a compaction replaced.
``--report DIR`` writes ``report.json`` and ``index.html`` (charts drawn by matplotlib, inline
SVG: ``pip install 'compactd[eval]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from compactd.scheduler.output import EXIT_OK, emit, say
from compactd.storage.database import embedded_url
from compactd.storage.errors import BadInput
from compactd.storage.tokens import tokenizer_knows
from compactd.worker.cost import usage_cost
from compactd.worker.replay import Session, Tally, read_transcript, replay, session_of
from compactd.worker.settings import Config, Settings, build_config, read_yaml


class EvalInputError(BadInput):
    """A transcript or configuration ``compactd eval`` cannot use."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration under evaluation."""

    name: str  # unique among the run's configurations
    path: Path
    config: Config


def transcript_paths(items: list[str]) -> list[Path]:
    """The files named, and the ``*.jsonl`` files under the folders named, in order."""
    out: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.rglob("*.jsonl"))
            if not found:
                raise EvalInputError(f"{path}: a folder with no *.jsonl transcript")
            out += found
        elif path.exists():
            out.append(path)
        else:
            raise EvalInputError(f"{path}: no such transcript")
    return out


def load_sessions(paths: list[Path], fmt: str) -> list[Session]:
    return [session_of(path.stem, path.parent.name, read_transcript(path, fmt))
            for path in paths]


def load_candidates(paths: list[str], home: Path) -> list[Candidate]:
    """Each configuration, loaded as a process would load it but with none of the environment:
    its store is an embedded one under ``home``."""
    out: list[Candidate] = []
    names: set[str] = set()
    for n, item in enumerate(paths, 1):
        path = Path(item)
        if not path.is_file():
            raise EvalInputError(f"--config {path}: no such file")
        where = home / f"config-{n}"
        where.mkdir()
        try:
            config = isolated_config(path, where)
        except BadInput as exc:
            raise EvalInputError(f"--config {path}: {exc}") from None
        name = path.stem if path.stem not in names else f"{path.stem}-{n}"
        names.add(name)
        out.append(Candidate(name, path, config))
    return out


def check_run_model(run_model: str, candidates: list[Candidate]) -> None:
    """``--run-model`` picks a model's window and tokenizer: it must be a model of every
    configuration's ``models`` (as ``summarization.model_name`` must be), or one the tokenizer
    knows by its name; any other (a typo) would be counted as an unknown model, silently."""
    if tokenizer_knows(run_model):
        return
    for candidate in candidates:
        if candidate.config.model(run_model) is None:
            raise EvalInputError(
                f"--run-model: {run_model!r} is not in models of --config {candidate.path}, "
                "and is no OpenAI or Anthropic model name the tokenizer knows")


def isolated_config(path: Path, home: Path) -> Config:
    """The configuration file ``path`` with nothing of the environment: every setting the
    environment could give is given here (an embedded store under ``home``, a broker in memory,
    no Redis), so no variable of the user's shell points a replay at their database."""
    settings = Settings(database_url=embedded_url(home), broker_url="memory://",
                        redis_url=None, config=None, home=str(home), metrics_port=None)
    return build_config(read_yaml(str(path)), settings=settings, home=home,
                        config_path=str(path))


class Progress:
    """A bar on ``stream`` when it is a terminal; nothing otherwise."""

    WIDTH = 30

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream
        self.shown = stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.shown:
            return
        filled = self.WIDTH * self.done // self.total
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                          f"{self.done}/{self.total} {label[:40]:<40}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


async def evaluate(candidate: Candidate, sessions: list[Session], progress: Progress, *,
                   run_model: str | None, context_window: int | None) -> dict[str, Any]:
    total = Tally()
    rows = []
    started = time.perf_counter()
    window = context_window or candidate.config.context_window(run_model)
    for n, session in enumerate(sessions, 1):
        tally = await replay(session, candidate.config, session_id=f"eval-{n}",
                             run_model=run_model, context_window=window)
        total.add(tally)
        rows.append({"session": session.name, "group": session.group,
                     "tokens": tally.source_tokens, **tally.report(),
                     "probes": tally.probe_report(), "lost": tally.lost})
        progress.step(f"{candidate.name}: {session.name}")
    return figures(candidate, total, rows, time.perf_counter() - started)


def settings_of(config: Config) -> dict[str, Any]:
    policy = config.policy
    return {"trigger": [[c.to_text() for c in clauses] for clauses in policy.trigger],
            "keep": policy.keep.to_text() if policy.keep else None,
            "trim_tokens_to_summarize": policy.trim_tokens_to_summarize,
            "max_summary_tokens": policy.max_summary_tokens, "layout": policy.layout,
            "models": [m.name for m in config.models] or ["local"]}


def figures(candidate: Candidate, total: Tally, rows: list[dict[str, Any]],
            seconds: float) -> dict[str, Any]:
    usage = total.usage()
    return {"name": candidate.name, "path": str(candidate.path),
            "settings": settings_of(candidate.config),
            "sessions": len(rows), "compacted_sessions": sum(1 for r in rows if r["compactions"]),
            **total.report(), "source_tokens": total.source_tokens,
            "compression": (round(total.source_tokens / total.final_tokens, 2)
                            if total.final_tokens else None),
            "usage": usage, "cost": usage_cost(usage, candidate.config.prices),
            "probes": total.probe_report(), "seconds": round(seconds, 1),
            "by_session": rows}


async def run_eval(candidates: list[Candidate], sessions: list[Session], *,
                   run_model: str | None, context_window: int | None) -> list[dict[str, Any]]:
    progress = Progress(len(candidates) * len(sessions))
    return [await evaluate(c, sessions, progress, run_model=run_model,
                           context_window=context_window) for c in candidates]


def print_side_by_side(results: list[dict[str, Any]]) -> None:
    rows = [("sessions compacted", lambda r: f"{r['compacted_sessions']}/{r['sessions']}"),
            ("compactions", lambda r: r["compactions"]),
            ("failed runs", lambda r: r["failed"]),
            ("summarizer calls", lambda r: r["calls"]),
            ("summarizer input tokens", lambda r: r["input_tokens"]),
            ("coverage", lambda r: _pct(r["coverage"])),
            ("compression", lambda r: f"{r['compression']}x" if r["compression"] else "-"),
            ("cost USD", lambda r: r["cost"]["usd"] if r["cost"]["usd"] is not None else "?"),
            ("probes", lambda r: r["probes"]["probes"]),
            ("probes kept or found", lambda r: _pct(r["probes"]["retention"]))]
    width = max(14, *(len(r["name"]) for r in results))
    say(f"{'':<24}" + "".join(f"{r['name']:>{width + 2}}" for r in results))
    for label, value in rows:
        say(f"{label:<24}" + "".join(f"{value(r)!s:>{width + 2}}" for r in results))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


async def cmd_eval(args: argparse.Namespace, _config: Config) -> int:
    paths = transcript_paths(args.transcripts)
    sessions = await asyncio.to_thread(load_sessions, paths, args.format)
    if args.report is not None:
        from compactd.scheduler.eval_report import check_report_dir

        check_report_dir(args.report)
    with tempfile.TemporaryDirectory(prefix="compactd-eval-") as tmp, _quiet_worker():
        candidates = load_candidates(args.eval_configs, Path(tmp))
        if args.run_model is not None:
            check_run_model(args.run_model, candidates)
        results = await run_eval(candidates, sessions, run_model=args.run_model,
                                 context_window=args.context_window)
    report: dict[str, Any] = {"transcripts": [str(p) for p in paths],
                              "run_model": args.run_model,
                              "context_window": args.context_window, "configs": results}
    written: list[Path] = []
    if args.report is not None:
        from compactd.scheduler.eval_report import write_report

        written = await asyncio.to_thread(write_report, args.report, report)
        report["written"] = [str(p) for p in written]
    if args.json:
        emit(report)
    else:
        print_side_by_side(results)
        for path in written:
            say(f"wrote {path}")
    return EXIT_OK


@contextlib.contextmanager
def _quiet_worker() -> Iterator[None]:
    """The worker's warnings off while replaying: a replay appends a session's steps within
    seconds, so the loop guard's time windows flag what an agent's pace would not, and a
    summarizer's refusal is counted in the report (``failed``)."""
    logger = logging.getLogger("compactd.worker")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
