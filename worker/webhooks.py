"""Webhooks: each event of :mod:`storage.events` POSTed to the URLs of ``events.webhooks``.

The body is the event's JSON. Three headers let a receiver trust it and drop a repeat:

- ``X-Compactd-Timestamp``: Unix seconds when this attempt was signed;
- ``X-Compactd-Signature``: ``sha256=`` and the hex HMAC-SHA256, keyed with the webhook's
  secret, of the timestamp, a dot and the body (a receiver refuses an old timestamp, so a
  captured request cannot be replayed later);
- ``X-Compactd-Delivery``: the delivery's id, the same on every attempt (delivery is at least
  once: a receiver that answered but whose answer was lost gets it again).

Each delivery is an ``events.deliver`` task on ``compaction.pressure``: a receiver that does not
answer 2xx is tried again ``events.retries`` times, waiting ``events.backoff_s`` and doubling
(each wait drawn between half and all of that), then counted in
``compactd_webhook_dead_letters``. The task carries the URL and the event, never the secret: the
worker reads it from its own configuration.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import random
import time
import uuid
from collections.abc import Mapping
from typing import Any

from compactd.storage.events import Event, EventKind, run_end_event, run_end_kind
from compactd.storage.records import SessionInfo
from compactd.storage.store import Store
from compactd.worker.keys import QUEUE_PRESSURE, TASK_WEBHOOK
from compactd.worker.llm.fallback import compute_backoff
from compactd.worker.run import Outcome
from compactd.worker.settings import Config, WebhookSpec

logger = logging.getLogger(__name__)

# The longest wait between two attempts.
BACKOFF_CAP_S = 300.0
# How long one attempt waits for the receiver's answer.
DELIVERY_TIMEOUT_S = 10.0
SIGNATURE_HEADER = "X-Compactd-Signature"
TIMESTAMP_HEADER = "X-Compactd-Timestamp"
DELIVERY_HEADER = "X-Compactd-Delivery"
EVENT_HEADER = "X-Compactd-Event"


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """What ``X-Compactd-Signature`` holds for ``body`` signed at ``timestamp``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def backoff_s(config: Config, retries_done: int, rng: random.Random | None = None) -> float:
    """The wait before retry number ``retries_done + 1``: ``events.backoff_s`` doubling up to
    the cap, jittered, so the workers retrying the deliveries of one outage do not all hit the
    receiver again at the same instant."""
    return compute_backoff(retries_done + 1, initial_s=config.events.backoff_s,
                           max_s=BACKOFF_CAP_S, rng=rng)


def send_event(app: Any, config: Config, event: Event) -> int:
    """Queue one delivery of ``event`` per webhook that wants it; how many. Blocking broker
    I/O (a task calls it from its thread; async callers hand it to one)."""
    sent = 0
    for hook in config.events.webhooks:
        if hook.wants(event.event):
            app.send_task(TASK_WEBHOOK, kwargs={"url": hook.url, "event": event.to_json(),
                                                "delivery_id": uuid.uuid4().hex},
                          queue=QUEUE_PRESSURE)
            sent += 1
    return sent


def webhook_for(config: Config, url: str) -> WebhookSpec | None:
    return next((hook for hook in config.events.webhooks if hook.url == url), None)


def post(hook: WebhookSpec, event: Mapping[str, Any], delivery_id: str) -> int:
    """POST ``event`` to ``hook``, signed now; the receiver's status. Raises
    :class:`httpx.HTTPError` when no answer came."""
    import httpx  # imported here: only a worker that delivers needs it

    body = json.dumps(event, separators=(",", ":")).encode()
    timestamp = int(time.time())
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: str(timestamp),
               SIGNATURE_HEADER: signature(hook.secret, timestamp, body),
               DELIVERY_HEADER: delivery_id, EVENT_HEADER: str(event.get("event"))}
    response = httpx.post(hook.url, content=body, headers=headers, timeout=DELIVERY_TIMEOUT_S)
    return response.status_code


def run_event_kind(outcome: Outcome) -> EventKind | None:
    """The event a run's end is (:func:`storage.events.run_end_kind`); None for a run that
    never started."""
    if outcome.run_id is None:
        return None
    return run_end_kind(outcome.outcome, outcome.failure_class)


def run_event(outcome: Outcome, info: SessionInfo) -> Event | None:
    """The event of :func:`run_event_kind`, on the session as the run left it."""
    if outcome.run_id is None:
        return None
    return run_end_event(info.id, info.tenant, outcome.run_id, version=info.surface_version,
                         seq=info.last_seq, status=outcome.outcome,
                         failure_class=outcome.failure_class)


async def send_run_event(app: Any, config: Config, store: Store, session_id: str,
                         outcome: Outcome) -> None:
    """Queue the deliveries of a run's event, when webhooks are configured. A failure is
    logged: the run is over whatever becomes of its webhooks."""
    if not config.events.webhooks or run_event_kind(outcome) is None:
        return  # most run ends are no event: the session is read only for those that are
    try:
        event = run_event(outcome, await store.get_session(session_id))
        if event is not None:
            await asyncio.to_thread(send_event, app, config, event)
    except Exception as exc:
        logger.warning("the run's webhooks were not queued: %s", exc,
                       extra={"action": "events.webhook_not_queued", "session_id": session_id})
