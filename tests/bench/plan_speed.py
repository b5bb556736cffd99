"""How long planning takes, and how it grows with the surface.

    python tests/bench/plan_speed.py [--json OUT.json] [--repeat N]

Builds synthetic agent surfaces (a user request, then steps of an assistant call, its tool result
and a short reply, with a pinned step and a reminder near the head) at 100 tokens a message, so
2,000 messages are 200k tokens. Token counts are computed once when the surface is built, as
storage does at append; the timed part is ``plan`` alone. Acceptance: the 2,000-message plan in
under 50 ms, and the time per message roughly constant across sizes (linear growth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compactd.storage.messages import Message, ToolCall
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.planner import plan
from compactd.worker.compaction.policy import parse_policy

SIZES = (500, 1000, 2000, 4000)
TOKENS_PER_MESSAGE = 100
TARGET_MS = 50.0
NOW = datetime(2026, 11, 30, tzinfo=UTC)
TEXT = ("Checked src/parser.py line 42: the <token> & its span look right, moving on. " * 5)


def surface(messages: int) -> list[SurfaceNode]:
    out: list[Message] = [Message(role="system", content="You are a coding agent."),
                          Message(role="user", content="Fix the failing parser tests.")]
    step = 0
    while len(out) < messages:
        step += 1
        call = ToolCall(id=f"call_{step}", name="bash", arguments=json.dumps({"cmd": "pytest"}))
        meta = {"pinned": True} if step == 3 else {}
        out.append(Message(role="assistant", content=TEXT, tool_calls=(call,), meta=meta))
        out.append(Message(role="tool", content=TEXT, tool_call_id=call.id, name="bash"))
        if step == 5:
            out.append(Message(role="user", content="(today is Monday)",
                               meta={"dynamic_context_reminder": True}))
        out.append(Message(role="assistant", content=TEXT))
    return [SurfaceNode(seq=i + 1, kind="message", message=m, tokens=TOKENS_PER_MESSAGE,
                        position=i) for i, m in enumerate(out[:messages])]


def measure(messages: int, repeat: int, policy_raw: dict[str, object]) -> dict[str, object]:
    nodes = surface(messages)
    policy = parse_policy(policy_raw).resolve(None)
    result = plan(nodes, policy=policy, now=NOW)  # warm caches (instruction size, encodings)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = plan(nodes, policy=policy, now=NOW)
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    step = result.summarize
    return {"messages": messages, "tokens": messages * TOKENS_PER_MESSAGE,
            "median_ms": round(statistics.median(times), 3),
            "p90_ms": round(times[int(len(times) * 0.9) - 1], 3),
            "us_per_message": round(statistics.median(times) * 1000 / messages, 2),
            "replaced": len(step.replace_seqs) if step else 0,
            "calls": len(step.calls) if step else 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=25)
    args = parser.parse_args()
    policy_raw: dict[str, object] = {"trigger": ["tokens", 10_000], "keep": ["messages", 20]}
    rows = [measure(n, args.repeat, policy_raw) for n in SIZES]
    print(f"{'messages':>8} {'tokens':>8} {'median ms':>10} {'p90 ms':>8} {'us/msg':>7} "
          f"{'replaced':>8} {'calls':>6}")
    for r in rows:
        print(f"{r['messages']:>8} {r['tokens']:>8} {r['median_ms']:>10} {r['p90_ms']:>8} "
              f"{r['us_per_message']:>7} {r['replaced']:>8} {r['calls']:>6}")
    at_2000 = next(r for r in rows if r["messages"] == 2000)
    per_message = [float(r["us_per_message"]) for r in rows]  # type: ignore[arg-type]
    spread = max(per_message) / min(per_message)
    ok = float(at_2000["median_ms"]) < TARGET_MS  # type: ignore[arg-type]
    print(f"2,000 messages / 200k tokens: {at_2000['median_ms']} ms median "
          f"(target < {TARGET_MS:g} ms: {'ok' if ok else 'MISSED'}); "
          f"time per message varies {spread:.2f}x across sizes (1.0 = perfectly linear)")
    if args.json:
        args.json.write_text(json.dumps({
            "policy": policy_raw, "tokens_per_message": TOKENS_PER_MESSAGE,
            "repeat": args.repeat, "sizes": rows, "target_ms": TARGET_MS, "ok": ok,
            "per_message_spread": round(spread, 3)}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
