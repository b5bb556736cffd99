"""Plan every real transcript of the corpus and check the plan's promises.

    python tests/bench/plan_corpus.py [CORPUS_DIR] [--json OUT.json]

For every ``CORPUS_DIR/*/*.jsonl`` (default ``../shared/corpus`` beside the repository): parse it
with ``storage.messages.read_jsonl``, count tokens with ``counter_for(None)``, and plan with
trigger tokens 1500 and keep messages 4 (not forced). Checked on every plan:

* the cut never splits a tool-call group (no result without its call, no call without all its
  results, on either side);
* every call's ``input_tokens`` is within the budget, and the prompt ``build_prompt`` really sends
  (with a maximal running summary) is no larger than the planned ``input_tokens``;
* the union of the calls' seqs is exactly ``replace_seqs``.

Then the same files go through the commands an operator runs (``--cli``, on by default):
``compactd ingest FILE --session S`` into an embedded SQLite file, and ``compactd plan S --json``
with a config of trigger tokens 1500 and keep messages 4, checked on the JSON alone: no tool group
split, every call's ``input_tokens`` within the budget, the calls' seqs covering exactly
``replace_seqs``. The commands run in this process through ``scheduler.cli.main`` (the same code
as the console script, without 244 interpreter start-ups).

This reads ``../shared``, which a fresh checkout does not have: a script, not a test.
Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compactd.storage.messages import read_jsonl  # noqa: E402
from compactd.storage.surface import SurfaceNode  # noqa: E402
from compactd.storage.tokens import counter_for  # noqa: E402
from compactd.worker.compaction.planner import Plan, plan  # noqa: E402
from compactd.worker.compaction.policy import Policy, parse_policy  # noqa: E402
from compactd.worker.compaction.prompt import build_prompt  # noqa: E402
from tests.support.pairs import cut_problems, json_rows, node_rows  # noqa: E402

POLICY = {"trigger": {"type": "tokens", "value": 1500}, "keep": {"type": "messages", "value": 4}}
NOW = datetime(2026, 11, 30, tzinfo=UTC)


def load(path: Path) -> list[SurfaceNode]:
    counter = counter_for(None)
    with path.open("rb") as fh:
        messages = [m for _, m in read_jsonl(fh)]
    return [SurfaceNode(seq=i + 1, kind="message", message=m, tokens=counter.count_message(m),
                        position=i) for i, m in enumerate(messages)]


def sent_tokens(messages: list[dict[str, Any]]) -> int:
    counter = counter_for(None)
    total = 0
    for m in messages:
        total += 3 + counter.count_text(str(m.get("content") or ""))
        for call in m.get("tool_calls") or ():
            fn = call["function"]
            total += 3 + counter.count_text(fn["name"]) + counter.count_text(fn["arguments"])
    return total


def check(nodes: list[SurfaceNode], result: Plan, policy: Policy) -> list[str]:
    step = result.summarize
    if step is None:
        return []
    problems = []
    replaced = set(step.replace_seqs)
    problems += cut_problems(node_rows(nodes), replaced)
    budget = policy.trim_tokens_to_summarize
    for call in step.calls:
        if budget is not None and call.input_tokens > budget:
            problems.append(f"call {call.index}: {call.input_tokens} tokens over {budget}")
        running = step.existing_summary if call.index == 0 else "word " * (
            policy.max_summary_tokens - 1)
        exact = sent_tokens(build_prompt(call, running, policy))
        if exact > call.input_tokens:
            problems.append(f"call {call.index}: sends {exact} tokens, planned "
                            f"{call.input_tokens}")
    union = []
    for call in step.calls:
        union += [s for s in call.seqs if s not in union]
    if union != list(step.replace_seqs):
        problems.append("the calls' seqs are not exactly replace_seqs")
    return problems


def check_json(surface: list[dict[str, Any]], planned: dict[str, Any], budget: int
               ) -> list[str]:
    """The plan's promises, read from ``surface --json`` and ``plan --json`` only."""
    step = planned["summarize"]
    if step is None:
        return []
    problems = []
    replaced = set(step["replace_seqs"])
    problems += [f"cli: {p}" for p in cut_problems(json_rows(surface), replaced)]
    problems += [f"cli: call {i} plans {c['input_tokens']} tokens, over {budget}"
                 for i, c in enumerate(step["calls"]) if c["input_tokens"] > budget]
    covered = {s for c in step["calls"] for s in c["seqs"]}
    if covered != replaced:
        problems.append("cli: the calls' seqs do not cover exactly replace_seqs")
    return problems


def run_cli(files: list[Path], corpus: Path) -> tuple[Counter[str], dict[str, list[str]]]:
    """ingest + plan --json for every file, through the CLI's own entry point."""
    import contextlib
    import io
    import os
    import tempfile

    import yaml

    from compactd.scheduler.cli import main as compactd

    def call(*args: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = compactd(list(args))
        if code != 0:
            raise RuntimeError(f"compactd {' '.join(args)} exited {code}")
        return out.getvalue()

    counts: Counter[str] = Counter()
    failures: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as home:
        config = Path(home) / "compactd.yaml"
        config.write_text(yaml.safe_dump({"summarization": POLICY}))
        saved = {k: os.environ.get(k) for k in ("COMPACTD_HOME", "COMPACTD_CONFIG",
                                                "COMPACTD_DATABASE_URL")}
        os.environ.update(COMPACTD_HOME=home, COMPACTD_CONFIG=str(config))
        os.environ.pop("COMPACTD_DATABASE_URL", None)
        try:
            for i, path in enumerate(files):
                session = f"corpus-{i}"
                call("ingest", str(path), "--session", session)
                surface = json.loads(call("surface", session, "--json"))["messages"]
                planned = json.loads(call("plan", session, "--json"))
                counts["files"] += 1
                counts["summarized"] += planned["summarize"] is not None
                problems = check_json(surface, planned, 4000)
                if problems:
                    failures[str(path.relative_to(corpus))] = problems
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    counts["violations"] = sum(len(p) for p in failures.values())
    return counts, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="?", type=Path, default=ROOT / ".." / "shared" / "corpus")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-cli", dest="cli", action="store_false",
                        help="skip the pass through compactd ingest / plan --json")
    args = parser.parse_args()
    files = sorted(args.corpus.glob("*/*.jsonl"))
    if not files:
        print(f"no transcripts under {args.corpus}", file=sys.stderr)
        return 2
    policy = parse_policy(POLICY).resolve(None)
    counts: Counter[str] = Counter()
    by_folder: dict[str, Counter[str]] = {}
    failures: dict[str, list[str]] = {}
    reasons: Counter[str] = Counter()
    for path in files:
        nodes = load(path)
        result = plan(nodes, policy=policy, now=NOW)
        folder = by_folder.setdefault(path.parent.name, Counter())
        for c in (counts, folder):
            c["files"] += 1
            c["messages"] += len(nodes)
            c["tokens"] += result.pressure.tokens
            c["fired"] += result.fired
            c["pruned"] += len(result.prune)
            if result.summarize is not None:
                c["summarized"] += 1
                c["replaced_messages"] += len(result.summarize.replace_seqs)
                c["replaced_tokens"] += result.summarize.replaced_tokens
                c["calls"] += len(result.summarize.calls)
                c["multi_call_plans"] += len(result.summarize.calls) > 1
                c["split_messages"] += len({p.seq for call in result.summarize.calls
                                            for p in call.pieces if p.parts > 1})
        if result.summarize is None:
            reasons[(result.why_no_summary or "").split(":")[0]] += 1
        problems = check(nodes, result, policy)
        if problems:
            failures[str(path.relative_to(args.corpus))] = problems
    counts["violations"] = sum(len(p) for p in failures.values())
    keys = ["files", "messages", "tokens", "fired", "summarized", "replaced_messages",
            "replaced_tokens", "calls", "multi_call_plans", "split_messages", "pruned"]
    print(f"{'folder':<20}" + "".join(f"{k:>18}" for k in keys))
    for name, c in [*sorted(by_folder.items()), ("all", counts)]:
        print(f"{name:<20}" + "".join(f"{c[k]:>18}" for k in keys))
    for reason, n in reasons.most_common():
        print(f"no summary ({n}): {reason}")
    print(f"violations: {counts['violations']}")
    for name, problems in failures.items():
        print(f"  {name}: {'; '.join(problems[:3])}")
    cli_counts: Counter[str] = Counter()
    if args.cli:
        cli_counts, cli_failures = run_cli(files, args.corpus)
        print(f"through compactd ingest + plan --json: {cli_counts['files']} files, "
              f"{cli_counts['summarized']} summarized, {cli_counts['violations']} violations")
        for name, problems in cli_failures.items():
            print(f"  {name}: {'; '.join(problems[:3])}")
            failures.setdefault(name, []).extend(problems)
    if args.json:
        args.json.write_text(json.dumps({
            "policy": POLICY, "counts": dict(counts), "cli": dict(cli_counts),
            "by_folder": {k: dict(v) for k, v in by_folder.items()},
            "no_summary_reasons": dict(reasons), "failures": failures}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
