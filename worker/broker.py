"""The Redis broker transport, with one client per channel instead of one per operation.

kombu's Redis channel builds a new ``redis.Redis`` for every operation that is not given one:
the unacked-index bookkeeping of each delivered message, its ack, and each task event it
publishes. Since redis-py 6 a client builds its table of response callbacks when it is made, so
a worker spent a measurable part of its CPU per compaction making clients it used once (README,
"Results"). A client is a stateless handle on the channel's connection pool (each command takes
a connection from the pool and gives it back), so one per channel and pool serves every
operation the same way.

Only compactd's Celery apps use it, through their own connection class (:class:`AMQP`, given to
``Celery(amqp=...)``): a :class:`Connection` resolves the redis schemes to :class:`Transport`
for itself. kombu's transport aliases stay as they are, so a runtime that uses kombu or Celery in
the same process is not affected, and the URI keeps its scheme (the worker's "Connected to"
line, Flower's broker page, which picks its broker by the scheme). Measured on kombu 5.7, which
pyproject pins: the channel overrides ``_create_client``, a private method.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kombu
from celery.app.amqp import AMQP as CeleryAMQP
from kombu.connection import ConnectionPool, PooledConnection
from kombu.transport import redis as kombu_redis
from kombu.utils.collections import HashedSeq
from kombu.utils.scheduling import priority_cycle
from redis.exceptions import ConnectionError as RedisConnectionError

from compactd.worker.keys import QUEUE_HOUSEKEEPING, QUEUES

SCHEMES = ("redis", "rediss")
# The Redis channel's ``queue_order_strategy`` (a broker transport option): see UrgentFirst.
QUEUE_ORDER = "compactd.worker.broker:UrgentFirst"


class UrgentFirst(priority_cycle):
    """The order a worker takes its queues in: compaction.housekeeping (beat's ticks), then
    compaction.urgent, then compaction.pressure, then compaction.bulk, every time a slot frees,
    whatever order ``-Q`` names them in.

    kombu's default (round robin) moves the queue it just took from to the back, so under load
    an overflow the runtime is blocked on waited behind a pressure run at every other slot.
    The Redis channel's one BRPOP lists the keys in this cycle's order and Redis pops the first
    non-empty one, so urgent is always served before other runs and bulk only when nothing
    else waits (queues of other names, none of compactd's, come after, in their own order).
    Beat's ticks go before urgent: a reap frees the sessions of dead workers, urgent runs'
    among them, and a tick is short."""

    def update(self, it: Iterable[str]) -> None:
        rank = {queue: i for i, queue in enumerate((QUEUE_HOUSEKEEPING, *QUEUES))}
        self.items[:] = sorted(it, key=lambda queue: rank.get(queue, len(rank)))


class Channel(kombu_redis.Channel):
    _sync_client: Any = None

    def _connparams(self, asynchronous: bool = False) -> Any:
        # A channel whose connection is gone answers with a connection error, the error every
        # caller of a broker operation expects from a dead broker. kombu asks for the
        # connection's parameters here and, once the connection is closed, fails with an
        # AttributeError that nothing catches. Celery 5.7 (celery/celery#10242, GH-9705)
        # collects a broken connection and then closes it: when Redis was down, the
        # collect's close of the channel stops at its pending BRPOP, the transport is
        # detached, and the close that follows restores the unacked messages of late-acked
        # tasks still running through that detached transport. The AttributeError ("'NoneType'
        # object has no attribute 'hostname'", as in celery/kombu#582 and #970) escapes
        # ignore_errors and the worker dies with its runs in flight. As a connection error,
        # the close ignores it and the consumer reconnects; the running task's message stays
        # in Redis's unacked set, redelivered after the visibility timeout if Redis kept it.
        if self.connection.client is None:
            raise RedisConnectionError("the broker connection of this channel is closed")
        return super()._connparams(asynchronous=asynchronous)

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


class Connection(kombu.Connection):
    """kombu's connection, whose redis schemes get :class:`Transport`. The connection keeps the
    scheme as its transport name, so what kombu derives from it stays kombu's: the URI and the
    default TLS options of ``rediss://``. Its clones and pooled connections are of its kind."""

    def get_transport_cls(self) -> Any:
        if self.transport_cls in SCHEMES:
            return Transport
        return super().get_transport_cls()

    def __eqhash__(self) -> Any:
        # kombu's registry of connection and producer pools (kombu.pools) is process-wide and
        # keyed by this: without the mark, a runtime's own connection to the same URL would
        # share a pool with compactd's, and one of them would get the other's transport.
        return HashedSeq(Connection, super().__eqhash__())

    def Pool(self, limit: int | None = None, **kwargs: Any) -> Any:
        return _ConnectionPool(self, limit=limit, **kwargs)


class _PooledConnection(PooledConnection, Connection):
    pass


class _ConnectionPool(ConnectionPool):
    def new(self) -> _PooledConnection:
        return _PooledConnection(self, **dict(self.connection._info(resolve=False)))


class AMQP(CeleryAMQP):
    """Celery's messaging part of an app, connecting through :class:`Connection`."""

    Connection = Connection
