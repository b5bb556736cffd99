"""The Redis broker transport (worker.broker) against a real Redis: a channel reuses one client
for its operations, takes a new one when kombu replaces its pool, and messages go through; only
compactd's apps get it, and kombu's own resolution of the redis scheme is left alone."""

from __future__ import annotations

from pathlib import Path

import kombu
import kombu.pools
import kombu.transport
from celery import Celery
from kombu import Queue
from kombu.transport import redis as kombu_redis

from compactd.worker.app import make_app
from compactd.worker.broker import Channel
from compactd.worker.settings import Settings, build_config


def app_for(broker_url: str, home: Path) -> Celery:
    config = build_config({}, settings=Settings(broker_url=broker_url,
                                                database_url="postgresql://x@127.0.0.1/x"),
                          home=home)
    return make_app(config)


def test_a_channel_reuses_its_client_and_messages_go_through(clean_redis: str,
                                                             tmp_path: Path) -> None:
    app = app_for(clean_redis, tmp_path)
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            assert isinstance(channel, Channel)
            first = channel._create_client()
            assert channel._create_client() is first
            # kombu drops the pool in a forked child: the next operation must not keep using
            # a client of the old pool.
            channel._pool = None
            second = channel._create_client()
            assert second is not first and second.connection_pool is channel.pool
            queue = Queue("compactd-broker-test", routing_key="compactd-broker-test")
            with conn.SimpleQueue(queue) as simple:
                for i in range(3):
                    simple.put({"n": i})
                got = []
                for _ in range(3):
                    message = simple.get(timeout=5)
                    got.append(message.payload["n"])
                    message.ack()
            assert got == [0, 1, 2]
    finally:
        app.close()


def test_redis_urls_keep_their_scheme_and_other_brokers_their_transport(
        clean_redis: str, tmp_path: Path) -> None:
    """The worker's "Connected to redis://" line and Flower's broker page read the URI."""
    app = app_for(clean_redis, tmp_path)
    embedded = app_for("filesystem://", tmp_path)
    try:
        with app.connection_for_write() as conn:
            assert conn.as_uri().startswith("redis://")
        with embedded.connection_for_write() as conn:
            assert not isinstance(conn.default_channel, Channel)
    finally:
        app.close()
        embedded.close()


def test_other_connections_in_the_process_keep_kombus_transport(clean_redis: str,
                                                                tmp_path: Path) -> None:
    """A runtime's own kombu or Celery in the same process as a compactd app gets kombu's Redis
    transport: the app resolves its transport for its own connections, never in kombu's tables."""
    aliases = dict(kombu.transport.TRANSPORT_ALIASES)
    app = app_for(clean_redis, tmp_path)
    try:
        with kombu.Connection(clean_redis) as theirs, \
                kombu.pools.connections[theirs].acquire(block=True) as pooled_theirs:
            # The app's connections: its own, their clones, the pooled ones tasks are sent on.
            with app.connection_for_write() as conn, conn.clone() as clone:
                assert isinstance(conn.default_channel, Channel)
                assert isinstance(clone.default_channel, Channel)
            with app.pool.acquire(block=True) as pooled:
                assert isinstance(pooled.default_channel, Channel)
            with app.producer_or_acquire() as producer:
                assert isinstance(producer.channel, Channel)
            assert dict(kombu.transport.TRANSPORT_ALIASES) == aliases
            # Theirs, opened first and pooled in kombu's process-wide registry, stay kombu's.
            assert type(theirs.default_channel) is kombu_redis.Channel
            assert type(pooled_theirs.default_channel) is kombu_redis.Channel
            assert theirs.as_uri().startswith("redis://")
    finally:
        app.close()
