"""Can one tenant's large append stall the others? Tenant B's request latency while tenant A
sends the largest appends the API accepts.

    python tests/bench/tenant_latency.py --json OUT.json [--repeat 3] [--idle-s 3]

What is measured: ``compactd serve`` runs as its own process on PostgreSQL (the database
``compactd_bench_tenant_latency``, created, migrated and emptied by the script) with Redis as the
broker (no worker: the trigger is out of reach, nothing is queued). Tenant B is one runtime
driving its own session as an agent does, one request at a time with no pause: append one small
message, then poll the surface with ``If-None-Match`` (answered 304), again and again. Each of
B's requests is timed from send to answer.

Tenant A, from a thread of its own with its own connection, sends one request at a time, each to a
fresh session of its own:

* ``4mb_text``: one append just under ``api.max_body_bytes`` (4 MiB by default): 64 tool
  results of ~64 KiB of prose each (about 1M o200k tokens in all), with the assistant turn
  that calls them;
* ``110k_messages``: one append of 110,000 tiny user messages (just under 4 MiB too).

Phases, one after the other: ``idle`` (B alone for ``--idle-s``), then ``--repeat`` appends of
each kind. B's samples of a phase are those sent while one of A's appends was in flight; A's own
append time is reported as well. A's bodies are encoded before the phase starts, so encoding
them costs the measuring process nothing while B is timed.

Reported per phase: B's p50 / p90 / p99 / max, the number of B's requests, and A's append times.
Goal (issue 15, item 3): B's p99 under 50 ms during both kinds of large append. The idle phase is
the floor on this machine (loopback HTTP, the append's commit and the poll's primary-key read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.common import (
    REDIS_URL,
    calibrate_pg,
    machine,
    machine_line,
    pg_url,
    prepare_pg,
    print_table,
    summary_ms,
    write_json,
)
from tests.support.api import TOKEN_A, TOKEN_B, bearer, start_api
from tests.support.services import flush_redis
from tests.support.stack import Stack

GOAL_P99_MS = 50.0
MAX_BODY_BYTES = 4 * 1024 * 1024
TOOL_RESULTS = 64
TINY_MESSAGES = 110_000
# Out of reach of every append here: nothing is enqueued, no worker is needed.
SUMMARIZATION = {"trigger": [{"type": "tokens", "value": 1_000_000_000}]}
WORDS = ("the", "build", "failed", "in", "module", "billing", "because", "the", "invoice",
         "rounding", "test", "expected", "a", "different", "total", "after", "tax", "step",
         "so", "parser", "was", "changed", "and", "suite", "ran", "again", "with", "focused",
         "cases", "passing", "except", "one", "flaky", "network", "check")


def prose(chars: int, rng: random.Random) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def big_text_body(rng: random.Random) -> bytes:
    """One agent step of 64 large tool results, the whole body just under the limit."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{i}.log"})}}
             for i in range(TOOL_RESULTS)]
    overhead = len(json.dumps({"messages": [{"role": "assistant", "content": None,
                                             "tool_calls": calls}]}))
    per_result = (MAX_BODY_BYTES - overhead - 4096) // TOOL_RESULTS - 64
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": None,
                                       "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": f"call_{i}", "content": prose(per_result, rng)}
                 for i in range(TOOL_RESULTS)]
    body = json.dumps({"messages": messages}).encode()
    assert len(body) <= MAX_BODY_BYTES, len(body)
    return body


def tiny_messages_body() -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": f"m{i}"}
                                    for i in range(TINY_MESSAGES)]},
                      separators=(",", ":")).encode()
    assert len(body) <= MAX_BODY_BYTES, len(body)
    return body


class TenantA(threading.Thread):
    """Sends its bodies one after the other; ``in_flight`` is set while one is being sent."""

    def __init__(self, url: str, bodies: list[tuple[str, bytes]]) -> None:
        super().__init__(name="tenant-a", daemon=True)
        self.url = url
        self.bodies = bodies
        self.in_flight = threading.Event()
        self.current = ""
        self.results: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, headers=bearer(TOKEN_A), timeout=600) as http:
                for n, (kind, body) in enumerate(self.bodies):
                    session = f"a-{kind}-{n}"
                    http.put(f"/v1/sessions/{session}",
                             json={"run_model": "gpt-4o"}).raise_for_status()
                    self.current = kind
                    self.in_flight.set()
                    started = time.perf_counter()
                    answer = http.post(f"/v1/sessions/{session}/messages", content=body,
                                       headers={"Content-Type": "application/json"})
                    took = time.perf_counter() - started
                    self.in_flight.clear()
                    if answer.status_code != 200:
                        raise RuntimeError(f"A's {kind} append: {answer.status_code} "
                                           f"{answer.text[:300]}")
                    self.results.append({"kind": kind, "ms": round(took * 1000, 1),
                                         "bytes": len(body), "tokens": answer.json()["tokens"]})
                    # B samples a moment of A's silence between appends (not counted).
                    time.sleep(0.3)
        except BaseException as exc:
            self.error = exc
            self.in_flight.clear()


async def tenant_b(url: str, stop: threading.Event, phase_of: Any,
                   samples: dict[str, list[float]]) -> int:
    """One runtime's steps, back to back, until ``stop``; returns the steps taken."""
    steps = 0
    async with httpx.AsyncClient(base_url=url, headers=bearer(TOKEN_B), timeout=60) as http:
        base = "/v1/sessions/b-runtime"
        (await http.put(base, json={"run_model": "gpt-4o"})).raise_for_status()
        while not stop.is_set():
            for request in ("append", "poll"):
                phase = phase_of()
                started = time.perf_counter()
                if request == "append":
                    answer = await http.post(f"{base}/messages", json={"messages": [
                        {"role": "user" if steps % 2 else "assistant",
                         "content": f"step {steps}: checked the log, moving on"}]})
                    ok = answer.status_code == 200
                    version = answer.json()["version"] if ok else None
                else:
                    answer = await http.get(f"{base}/surface",
                                            headers={"If-None-Match": f'"{version}"'})
                    ok = answer.status_code == 304
                took = (time.perf_counter() - started) * 1000
                if not ok:
                    raise RuntimeError(f"B's {request}: {answer.status_code} {answer.text[:300]}")
                # A sample counts for a phase only when it began and ended inside it.
                if phase is not None and phase == phase_of():
                    samples.setdefault(phase, []).append(took)
            steps += 1
    return steps


def run(url: str, *, repeat: int, idle_s: float) -> dict[str, Any]:
    rng = random.Random(15)
    bodies = [("4mb_text", big_text_body(rng)) for _ in range(repeat)]
    bodies += [("110k_messages", tiny_messages_body()) for _ in range(repeat)]
    tenant_a = TenantA(url, bodies)
    samples: dict[str, list[float]] = {}
    stop = threading.Event()
    state = {"idle": True}

    def phase_of() -> str | None:
        if state["idle"]:
            return "idle"
        return tenant_a.current if tenant_a.in_flight.is_set() else None

    async def drive() -> int:
        b = asyncio.create_task(tenant_b(url, stop, phase_of, samples))
        await asyncio.sleep(idle_s)
        state["idle"] = False
        tenant_a.start()
        while tenant_a.is_alive() and not b.done():
            await asyncio.sleep(0.05)
        stop.set()
        return await b

    steps = asyncio.run(drive())
    if tenant_a.error is not None:
        raise tenant_a.error
    phases = {phase: summary_ms(values) for phase, values in samples.items()}
    return {"b_steps": steps, "b_requests": phases, "a_appends": tenant_a.results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=3, help="appends of each kind")
    parser.add_argument("--idle-s", type=float, default=3.0, help="B alone first (seconds)")
    parser.add_argument("--cpu-processes", type=int, default=None,
                        help="api.cpu_processes (default: the config's; 0: the CPU thread)")
    args = parser.parse_args(argv)

    database = prepare_pg(pg_url("tenant_latency"))
    flush_redis(REDIS_URL)
    info = machine()
    calibration = calibrate_pg(database)
    with tempfile.TemporaryDirectory(prefix="compactd-tenant-latency-") as home, \
            Stack(database, REDIS_URL, Path(home), summarization=SUMMARIZATION) as stack:
        url = start_api(stack, api=None if args.cpu_processes is None
                        else {"cpu_processes": args.cpu_processes})
        result = run(url, repeat=args.repeat, idle_s=args.idle_s)
    phases = result["b_requests"]
    loaded = [phases[k] for k in ("4mb_text", "110k_messages") if k in phases]
    worst_p99 = max((p["p99_ms"] for p in loaded), default=float("nan"))
    report = {"machine": info, "pg_calibration": calibration, "goal_p99_ms": GOAL_P99_MS,
              "cpu_processes": args.cpu_processes,
              "worst_p99_ms": worst_p99, "goal_met": worst_p99 < GOAL_P99_MS, **result}

    print(machine_line(info))
    print_table(["B during", "requests", "p50 ms", "p90 ms", "p99 ms", "max ms"],
                [[phase, p["n"], p.get("p50_ms"), p.get("p90_ms"), p.get("p99_ms"),
                  p.get("max_ms")] for phase, p in phases.items()])
    print()
    print_table(["A's append", "bytes", "tokens", "ms"],
                [[a["kind"], a["bytes"], a["tokens"], a["ms"]] for a in result["a_appends"]])
    print(f"\nB's worst p99 during a large append: {worst_p99:.1f} ms "
          f"(goal < {GOAL_P99_MS:g} ms): {'met' if report['goal_met'] else 'NOT met'}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
