"""Webhooks on the user's path: a receiver on 127.0.0.1 (http.server in a thread of the test) gets
the events of runs a real Celery worker ran (real PostgreSQL and Redis, the fake provider over
HTTP as the summarizer), signed; one that is down at first gets them once it is back; one that
never comes back is counted as dead-lettered in the worker's metrics."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
import pytest

from compactd.client import CompactdClient
from compactd.storage.errors import ConfigError
from compactd.storage.kinds import RunStatus
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.metrics import scrape, value
from tests.support.probes import free_port
from tests.support.stack import wait_until
from tests.support.worker_stack import db

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

POLICY = {"trigger": [{"type": "tokens", "value": 10**9}],
          "keep": {"type": "messages", "value": 4}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 100_000}
SECRET = "whsec-5d1c7a0b"


class Received:
    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(body) for _, body in self.requests]


@contextmanager
def receiver(port: int, received: Received) -> Iterator[None]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.requests.append((dict(self.headers), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def signed_as_documented(headers: dict[str, str], body: bytes) -> bool:
    stamp = headers["X-Compactd-Timestamp"]
    mac = hmac.new(SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["X-Compactd-Signature"], f"sha256={mac}") \
        and abs(time.time() - int(stamp)) < 120


def hooks(port: int, **extra: Any) -> dict[str, Any]:
    return {"events": {"webhooks": [{"url": f"http://127.0.0.1:{port}/hook", "secret": SECRET}],
                       **extra}}


def test_a_receiver_gets_signed_events_and_one_down_gets_them_when_back(
        make_stack, fake: FakeProvider, db: Db) -> None:  # type: ignore[no-untyped-def]
    up_port, down_port = free_port(), free_port()
    config = hooks(up_port, retries=6, backoff_s=0.5)
    config["events"]["webhooks"].append(
        {"url": f"http://127.0.0.1:{down_port}/hook", "secret": SECRET,
         "events": ["compaction.committed"]})
    stack = make_stack(summarization=POLICY, worker={"local_fallback": False},
                       extra_config=config)
    stack.ingest("s1", [{"role": "user", "content": f"message {i} " * 40} for i in range(12)])
    stack.ingest("s2", [{"role": "user", "content": f"message {i} " * 40} for i in range(12)])
    stack.start_worker("w1", concurrency=2)
    up, back = Received(), Received()
    with receiver(up_port, up):
        stack.cli("compact", "s1", "--wait")
        fake.script(Behaviour(model="fake-gpt", status=400, times=-1))
        stack.cli("compact", "s2", "--wait", check=False)
        wait_until(lambda: len(up.requests) >= 2, timeout=30, what="both events at the receiver")
        # The second webhook's receiver is down: its delivery is being retried meanwhile.
        time.sleep(1.5)
        with receiver(down_port, back):
            wait_until(lambda: back.requests, timeout=30,
                       what="the delivery to the receiver that came back")
    [committed] = [r for r in db.runs("s1")]
    [failed] = [r for r in db.runs("s2")]
    assert committed.status == RunStatus.COMMITTED and failed.status == RunStatus.FAILED
    events = sorted(up.events(), key=lambda e: e["session"])
    assert [(e["event"], e["session"], e["run_id"]) for e in events] == [
        ("compaction.committed", "s1", committed.id), ("compaction.failed", "s2", failed.id)]
    assert events[0]["version"] == db.session("s1").surface_version
    assert events[1]["outcome"] == failed.failure_class
    assert all(signed_as_documented(headers, body) for headers, body in up.requests)
    # The one that came back: only the kind it asked for, once, signed.
    assert [(e["event"], e["session"]) for e in back.events()] == [("compaction.committed", "s1")]
    assert all(signed_as_documented(headers, body) for headers, body in back.requests)
    assert "webhook delivery failed" in stack.log("w1")


def test_a_receiver_that_stays_down_is_a_dead_letter(make_stack, fake: FakeProvider,
                                                     db: Db) -> None:  # type: ignore[no-untyped-def]
    metrics_port = free_port()
    stack = make_stack(summarization=POLICY, extra_config=hooks(free_port(), retries=2,
                                                                 backoff_s=0.2))
    stack.ingest("s1", [{"role": "user", "content": f"message {i} " * 40} for i in range(12)])
    stack.start_worker("w1", concurrency=2, env={"COMPACTD_METRICS_PORT": str(metrics_port)})
    stack.cli("compact", "s1", "--wait")
    wait_until(lambda: value(scrape(metrics_port), "compactd_webhook_dead_letters_total",
                             event="compaction.committed") == 1, timeout=30,
               what="the dead letter")
    samples = scrape(metrics_port)
    assert value(samples, "compactd_webhook_deliveries_total", event="compaction.committed",
                 result="retried") == 2
    assert value(samples, "compactd_webhook_deliveries_total", event="compaction.committed",
                 result="delivered") == 0


def test_a_webhook_url_that_is_not_http_is_refused_at_load_naming_the_key(
        make_stack) -> None:  # type: ignore[no-untyped-def]
    for url in ("ftp://127.0.0.1/hook", "127.0.0.1:8080/hook", "http:///nohost"):
        stack = make_stack(summarization=POLICY, extra_config={
            "events": {"webhooks": [{"url": url, "secret": SECRET}]}})
        out = stack.cli("status", check=False)
        assert out.returncode == 2, out
        assert "events.webhooks[0].url: " in out.stderr and url in out.stderr, out.stderr
        with pytest.raises(ConfigError, match=r"events\.webhooks\[0\]\.url"):
            load_config(env=stack.env)


def test_an_overflow_served_is_an_event_for_listeners_and_webhooks(
        make_stack, fake: FakeProvider, db: Db) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    stack = make_stack(summarization=POLICY, extra_config=hooks(port))
    stack.ingest("s1", [{"role": "user", "content": f"message {i} " * 40} for i in range(12)])
    stack.start_worker("w1", concurrency=2)
    received = Received()

    async def overflow() -> tuple[Any, list[dict[str, Any]]]:
        listening = await asyncpg.connect(stack.database_url)
        heard: list[dict[str, Any]] = []
        await listening.add_listener("compactd_events",
                                     lambda *args: heard.append(json.loads(args[-1])))
        async with CompactdClient(load_config(env=stack.env)) as client:
            session = await client.get_session("s1")
            served = await session.report_overflow(timeout_s=60)
        await asyncio.sleep(0.3)
        await listening.close()
        return served, heard

    with receiver(port, received):
        served, heard = asyncio.run(overflow())
        wait_until(lambda: any(e["event"] == "session.overflow_served"
                               for e in received.events()), timeout=30,
                   what="session.overflow_served at the receiver")
    assert served.compacted
    [run] = db.runs("s1")
    [event] = [e for e in heard if e["event"] == "session.overflow_served"]
    assert event == {"event": "session.overflow_served", "session": "s1", "tenant": "default",
                     "run_id": run.id, "version": served.version, "seq": None,
                     "outcome": RunStatus.COMMITTED}
    assert event in received.events()
    assert all(signed_as_documented(headers, body) for headers, body in received.requests)
