"""100 runtimes at once through ``compactd serve`` for 30 s, on PostgreSQL: no error, no lost
message, and the log replays to the stored surface for every session."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.support.api import TOKEN_A, bearer, start_api

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

CLIENTS = 100
DURATION_S = 30.0
FULL_READ_EVERY = 10  # steps; the others poll with If-None-Match


@dataclass
class Runtime:
    """One agent runtime's view: what it appended, and what went wrong."""

    session: str
    appended: list[str] = field(default_factory=list)
    steps: int = 0
    polls_304: int = 0
    full_reads: int = 0
    errors: list[str] = field(default_factory=list)
    append_s: list[float] = field(default_factory=list)
    poll_s: list[float] = field(default_factory=list)


def step_messages(runtime: Runtime) -> list[dict[str, Any]]:
    n = runtime.steps
    if n % 3 == 2:  # a tool round trip: the call and its result in one step
        call = f"call_{n}"
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": call, "type": "function",
                     "function": {"name": "read_file", "arguments": f'{{"n": {n}}}'}}]},
                {"role": "tool", "tool_call_id": call, "content": f"{runtime.session} result {n}"}]
    role = "user" if n % 3 == 0 else "assistant"
    return [{"role": role, "content": f"{runtime.session} step {n}"}]


async def drive(http: httpx.AsyncClient, runtime: Runtime, deadline: float) -> None:
    base = f"/v1/sessions/{runtime.session}"
    created = await http.put(base, json={"run_model": "gpt-4o"})
    if created.status_code != 201:
        runtime.errors.append(f"create: {created.status_code} {created.text[:200]}")
        return
    while time.monotonic() < deadline:
        messages = step_messages(runtime)
        try:
            sent = time.monotonic()
            step = await http.post(f"{base}/messages", json={"messages": messages})
            runtime.append_s.append(time.monotonic() - sent)
            if step.status_code != 200:
                runtime.errors.append(f"append: {step.status_code} {step.text[:200]}")
                return
            runtime.appended.extend(str(m["content"]) for m in messages)
            runtime.steps += 1
            version = step.json()["version"]
            if runtime.steps % FULL_READ_EVERY == 0:
                surface = await http.get(f"{base}/surface")
                runtime.full_reads += 1
                seen = [str(m["content"]) for m in surface.json()["messages"]]
                if surface.status_code != 200 or seen != runtime.appended:
                    runtime.errors.append(f"surface after step {runtime.steps}: "
                                          f"{len(seen)} messages, {len(runtime.appended)} sent")
                    return
            else:
                # What a runtime does before each model call: nobody else writes this session
                # (no worker runs here), so the version its own append returned is current.
                sent = time.monotonic()
                poll = await http.get(f"{base}/surface",
                                      headers={"If-None-Match": f'"{version}"'})
                runtime.poll_s.append(time.monotonic() - sent)
                if poll.status_code != 304:
                    runtime.errors.append(f"poll: {poll.status_code} {poll.text[:200]}")
                    return
                runtime.polls_304 += 1
        except httpx.HTTPError as exc:
            runtime.errors.append(f"{type(exc).__name__}: {exc}")
            return


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))] if values else 0.0


async def run_clients(url: str) -> tuple[list[Runtime], float]:
    runtimes = [Runtime(f"load-{i:03d}") for i in range(CLIENTS)]
    # One client per runtime, as separate runtimes would have (one shared pool of 100
    # connections spends more CPU finding a free connection than the server spends answering).
    clients = [httpx.AsyncClient(base_url=url, headers=bearer(TOKEN_A), timeout=60)
               for _ in runtimes]
    try:
        started = time.monotonic()
        deadline = started + DURATION_S
        await asyncio.gather(*(drive(http, r, deadline)
                               for http, r in zip(clients, runtimes, strict=True)))
        elapsed = time.monotonic() - started
        # The last word goes to the database: every message each runtime was told it appended.
        for http, runtime in zip(clients, runtimes, strict=True):
            surface = (await http.get(f"/v1/sessions/{runtime.session}/surface")).json()
            stored = [str(m["content"]) for m in surface["messages"]]
            if stored != runtime.appended:
                runtime.errors.append(f"stored {len(stored)}, appended {len(runtime.appended)}")
    finally:
        for http in clients:
            await http.aclose()
    return runtimes, elapsed


@pytest.mark.timed
def test_100_clients_append_and_poll_for_30_s_without_error_or_loss(make_stack) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack()
    url = start_api(stack)
    runtimes, elapsed = asyncio.run(run_clients(url))

    errors = Counter(e for r in runtimes for e in r.errors)
    assert not errors, errors.most_common(5)
    steps = sum(r.steps for r in runtimes)
    messages = sum(len(r.appended) for r in runtimes)
    requests = steps * 2 + sum(r.full_reads for r in runtimes)
    appends = sorted(t for r in runtimes for t in r.append_s)
    polls = sorted(t for r in runtimes for t in r.poll_s)
    print(f"\n{CLIENTS} clients, {elapsed:.1f} s: {steps} appends ({messages} messages), "
          f"{len(polls)} polls answered 304, {requests / elapsed:.0f} requests/s; "
          f"append p50 {percentile(appends, 0.5):.3f} s p95 {percentile(appends, 0.95):.3f} s, "
          f"poll p50 {percentile(polls, 0.5):.3f} s p95 {percentile(polls, 0.95):.3f} s")
    # Throughput depends on the machine (two shared cores in CI); every client must have run
    # append-and-poll steps all along, which is what the loss check needs.
    assert all(r.steps >= 3 and r.polls_304 >= 1 for r in runtimes), "a client barely ran"
    verified = stack.cli("verify", "--all")
    assert f"{CLIENTS}/{CLIENTS} sessions verified" in verified.stdout, verified.stdout[-2000:]
