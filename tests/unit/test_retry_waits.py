"""The waits before a task is tried again (a run after the database was unavailable, a webhook
delivery, a bulk item whose session was leased): doubling up to a cap (a bulk item's wait is
its cap from the first), and jittered so a fleet of workers does not retry in lockstep."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from compactd.worker.settings import build_config
from compactd.worker.tasks import (
    DATABASE_RETRY_CAP_S,
    DATABASE_RETRY_FIRST_S,
    bulk_busy_countdown,
    database_retry_countdown,
)
from compactd.worker.webhooks import BACKOFF_CAP_S, backoff_s

Wait = Callable[[int, random.Random | None], float]
HOOKS = build_config({"events": {"backoff_s": 0.5}})

WAITS: list[tuple[str, Wait, float, float]] = [
    ("database", database_retry_countdown, DATABASE_RETRY_FIRST_S, DATABASE_RETRY_CAP_S),
    ("webhook", lambda n, rng: backoff_s(HOOKS, n, rng), 0.5, BACKOFF_CAP_S),
    # A third to two thirds of a 30 s lease, whatever the retry's number.
    ("bulk busy", lambda n, rng: bulk_busy_countdown(n, 30.0, rng), 20.0, 20.0),
]


@pytest.mark.parametrize(("name", "wait", "first", "cap"), WAITS, ids=[w[0] for w in WAITS])
def test_retry_waits_differ_across_calls_and_stay_within_half_and_all_of_the_doubled_wait(
        name: str, wait: Wait, first: float, cap: float) -> None:
    for retries_done in (0, 3, 40):
        full = min(cap, first * 2 ** retries_done)
        waits = [wait(retries_done, None) for _ in range(50)]
        assert all(full / 2 <= w <= full for w in waits), (name, retries_done, waits)
        assert len(set(waits)) > 40, (name, retries_done, waits)  # no two workers in step


@pytest.mark.parametrize(("name", "wait", "first", "cap"), WAITS, ids=[w[0] for w in WAITS])
def test_retry_waits_are_deterministic_given_the_random_source(
        name: str, wait: Wait, first: float, cap: float) -> None:
    a = [wait(n, random.Random(7)) for n in range(6)]
    b = [wait(n, random.Random(7)) for n in range(6)]
    assert a == b, name


def test_the_webhook_wait_starts_from_events_backoff_s() -> None:
    assert 1.0 <= backoff_s(build_config({}), 0) <= 2.0
