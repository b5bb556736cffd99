"""The Redis broker transport, with one client per channel instead of one per operation.

kombu's Redis channel builds a new ``redis.Redis`` for every operation that is not given one:
the unacked-index bookkeeping of each delivered message, its ack, and each task event it
publishes. Since redis-py 6 a client builds its table of ~200 response callbacks when it is made,
so a worker spent ~5% of its CPU per compaction making clients it used once (throughput bench,
three alternating pairs: 11.83 -> 11.25 ms). A client is a stateless handle on the channel's
connection pool (each command takes a connection from the pool and gives it back), so one per
channel and pool serves every operation the same way.

:func:`install` makes it the transport of ``redis://`` and ``rediss://`` URLs in this process,
through kombu's transport aliases rather than Celery's ``broker_transport`` setting: with the
setting, connection URIs (the worker's "Connected to" line, Flower's broker page) would show the
class path instead of the redis scheme, and Flower would not recognise the broker.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kombu.transport
from kombu.transport import redis as kombu_redis
from kombu.utils.scheduling import priority_cycle

from worker.keys import QUEUES

TRANSPORT = "worker.broker:Transport"
SCHEMES = ("redis", "rediss")
# The Redis channel's ``queue_order_strategy`` (a broker transport option): see UrgentFirst.
QUEUE_ORDER = "worker.broker:UrgentFirst"


class UrgentFirst(priority_cycle):
    """The order a worker takes its queues in: compaction.urgent, then compaction.pressure, then
    compaction.bulk, every time a slot frees, whatever order ``-Q`` names them in.

    kombu's default (round robin) moves the queue it just took from to the back, so under load
    an overflow the runtime is blocked on waited behind a pressure run at every other slot.
    The Redis channel's one BRPOP lists the keys in this cycle's order and Redis pops the first
    non-empty one, so urgent is always served first and bulk only when nothing else waits
    (queues of other names, none of compactd's, come after, in their own order)."""

    def update(self, it: Iterable[str]) -> None:
        rank = {queue: i for i, queue in enumerate(QUEUES)}
        self.items[:] = sorted(it, key=lambda queue: rank.get(queue, len(rank)))


class Channel(kombu_redis.Channel):
    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        # A new pool (kombu drops the old one in a forked child) gets a new client.
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Resolve the redis schemes to :class:`Transport` in this process (idempotent). Only for
    compactd's own processes (worker, beat, Flower, the CLI): it changes kombu for everyone."""
    cache = getattr(kombu.transport, "_transport_cache", {})
    for scheme in SCHEMES:
        kombu.transport.TRANSPORT_ALIASES[scheme] = TRANSPORT
        # kombu caches a resolved alias; one resolved before this call is resolved again.
        if cache.get(scheme) is not Transport:
            cache.pop(scheme, None)


def transport_setting(broker_url: str) -> str | None:
    """The ``broker_transport`` setting that gives one app :class:`Transport` for a Redis URL
    without touching kombu's aliases (a runtime's process may use kombu for itself); None for
    other brokers. Such an app's connection URIs name the class instead of the scheme, which
    only logs of enqueueing clients show."""
    scheme = broker_url.split("://", 1)[0].lower()
    return TRANSPORT if scheme in SCHEMES else None
