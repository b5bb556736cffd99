"""How much of what matters the local summarizer keeps, over a corpus of real transcripts.

    python tests/bench/local_retention.py --json OUT.json [--corpus DIR] [--max-tokens N]

For every ``*.jsonl`` file under the corpus (default ``../shared/corpus`` next to the repository),
the whole session is summarized by ``local`` and checked: the file paths and exception type names
found in its tool results (as ``worker.llm.local.find_paths`` / ``find_exception_names`` define
them) that are still in the summary, the eight headings, and the token ratio (summary tokens over
input tokens, the o200k counter). Prints a table, writes the JSON report, and exits 1 if any
session's summary is not strictly smaller than its input or misses a heading.

Sessions without tool results (plain-chat trajectories whose observations are user turns) have
nothing to retain under that definition; they are still checked for size and headings. A second,
informative measure covers them: the paths and exception names found anywhere outside system
messages (``*_anywhere``). The summarizer guarantees only the first; the second shows what it keeps
when it has room.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from compactd.storage.messages import read_jsonl  # noqa: E402
from compactd.storage.tokens import counter_for  # noqa: E402
from compactd.worker.compaction.policy import DEFAULT_MAX_SUMMARY_TOKENS  # noqa: E402
from compactd.worker.llm.local import (  # noqa: E402
    SECTIONS,
    find_exception_names,
    find_paths,
    summarize_local,
    tool_result_facts,
)


def measure(path: Path, max_tokens: int) -> dict[str, Any]:
    messages = [m for _, m in read_jsonl(path.read_bytes().splitlines())]
    counter = counter_for(None)
    paths, errors = tool_result_facts(messages)
    started = time.perf_counter()
    summary = summarize_local(messages, max_tokens=max_tokens)
    elapsed = time.perf_counter() - started
    tokens_in = sum(counter.count_message(m) for m in messages)
    tokens_out = counter.count_text(summary)
    text = "\n".join(m.text for m in messages if m.role != "system")
    anywhere = list(dict.fromkeys([*find_paths(text), *find_exception_names(text)]))
    kept_paths = [p for p in paths if p in summary]
    kept_errors = [e for e in errors if e in summary]
    return {
        "file": str(path), "messages": len(messages), "tool_results": sum(
            m.role == "tool" for m in messages),
        "tokens_in": tokens_in, "tokens_out": tokens_out,
        "ratio": round(tokens_out / tokens_in, 4) if tokens_in else None,
        "paths": len(paths), "paths_kept": len(kept_paths),
        "errors": len(errors), "errors_kept": len(kept_errors),
        "missing": [f for f in [*paths, *errors] if f not in summary],
        "anywhere": len(anywhere), "anywhere_kept": sum(f in summary for f in anywhere),
        "headings": all(f"## {s}" in summary for s in SECTIONS),
        "smaller": tokens_out < tokens_in, "seconds": round(elapsed, 4),
    }


def _rate(kept: int, total: int) -> float | None:
    return round(kept / total, 4) if total else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", required=True, help="where to write the report")
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared" / "corpus"))
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_SUMMARY_TOKENS)
    args = parser.parse_args(argv)
    files = sorted(Path(args.corpus).rglob("*.jsonl"))
    if not files:
        print(f"no .jsonl files under {args.corpus}", file=sys.stderr)
        return 2
    rows = [measure(f, args.max_tokens) for f in files]
    paths = sum(r["paths"] for r in rows)
    errors = sum(r["errors"] for r in rows)
    paths_kept = sum(r["paths_kept"] for r in rows)
    errors_kept = sum(r["errors_kept"] for r in rows)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    report = {
        "corpus": args.corpus, "files": len(rows), "max_tokens": args.max_tokens,
        "paths": paths, "paths_kept": paths_kept, "path_retention": _rate(paths_kept, paths),
        "errors": errors, "errors_kept": errors_kept,
        "error_retention": _rate(errors_kept, errors),
        "fact_retention": _rate(paths_kept + errors_kept, paths + errors),
        "sessions_with_facts": sum(1 for r in rows if r["paths"] + r["errors"]),
        "anywhere": sum(r["anywhere"] for r in rows),
        "anywhere_retention": _rate(sum(r["anywhere_kept"] for r in rows),
                                    sum(r["anywhere"] for r in rows)),
        "sessions_fully_retained": sum(1 for r in rows if not r["missing"]),
        "token_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "token_ratio_max": max(ratios) if ratios else None,
        "all_smaller": all(r["smaller"] for r in rows),
        "all_headings": all(r["headings"] for r in rows),
        "seconds_total": round(sum(r["seconds"] for r in rows), 3),
        "sessions": rows,
    }
    width = max(len(Path(r["file"]).name) for r in rows)
    print(f"{'session':<{width}}  {'in':>6} {'out':>5} {'ratio':>6}  {'paths':>9} {'errors':>7}"
          f"  {'anywhere':>9}")
    for r in rows:
        print(f"{Path(r['file']).name:<{width}}  {r['tokens_in']:>6} {r['tokens_out']:>5} "
              f"{r['ratio']:>6.3f}  {r['paths_kept']:>4}/{r['paths']:<4} "
              f"{r['errors_kept']:>3}/{r['errors']:<3}  {r['anywhere_kept']:>4}/{r['anywhere']:<4}")
    print(f"\n{len(rows)} sessions ({report['sessions_with_facts']} with facts in tool results): "
          f"paths {paths_kept}/{paths} ({report['path_retention']}), "
          f"exceptions {errors_kept}/{errors} ({report['error_retention']}), "
          f"anywhere outside system messages {report['anywhere_retention']}, "
          f"token ratio median {report['token_ratio_median']} max {report['token_ratio_max']}, "
          f"all smaller: {report['all_smaller']}, all headings: {report['all_headings']}")
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if report["all_smaller"] and report["all_headings"] else 1


if __name__ == "__main__":
    sys.exit(main())
