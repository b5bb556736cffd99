"""The runway arithmetic: the growth rate the append keeps, its decay while a session is idle,
and the time left before the window at that rate."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from compactd.storage.records import (
    GROWTH_WINDOW_S,
    SessionInfo,
    decayed_growth_rate,
    next_growth_rate,
)
from compactd.worker.pressure import runway, sorted_runways
from compactd.worker.settings import Config, load_config

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return load_config({"COMPACTD_HOME": str(tmp_path)})


def session(sid: str = "s1", **fields: Any) -> SessionInfo:
    values: dict[str, Any] = {
        "id": sid, "tenant": "default", "run_model": "gpt-4o", "context_window": 10_000,
        "envelope": None, "envelope_tokens": 0, "policy": None, "surface_version": 1,
        "surface_tokens": 8_000, "surface_messages": 10, "last_seq": 10, "last_position": 10,
        "reported_input_tokens": None, "reported_version": None,
        "reported_output_tokens": None, "reported_base_tokens": None, "signal_at": None,
        "lease_owner": None, "lease_run_id": None, "lease_expires_at": None, "lease_fence": 0,
        "cooldown_until": None, "flagged_reason": None, "flagged_at": None,
        "created_at": T0 - dt.timedelta(hours=1), "last_append_at": T0, "growth_rate": 10.0}
    values.update(fields)
    return SessionInfo(**values)


def test_a_steady_session_is_measured_at_exactly_its_rate() -> None:
    # 100 tokens every 10 s is 10 tokens/s: the rate is the recurrence's fixed point.
    assert next_growth_rate(10.0, 100, 10.0) == pytest.approx(10.0)
    rate = 0.0
    for _ in range(100):
        rate = next_growth_rate(rate, 100, 10.0)
    assert rate == pytest.approx(10.0, rel=1e-3)


def test_appends_in_the_same_instant_add_up_without_dividing_by_zero() -> None:
    once = next_growth_rate(0.0, 1_200, 0.0)
    twice = next_growth_rate(next_growth_rate(0.0, 600, 0.0), 600, 0.0)
    assert once == twice == pytest.approx(1_200 / GROWTH_WINDOW_S)


def test_a_clock_step_backwards_counts_as_no_time() -> None:
    assert next_growth_rate(5.0, 120, -30.0) == next_growth_rate(5.0, 120, 0.0)


def test_an_idle_session_slows_down() -> None:
    assert decayed_growth_rate(10.0, 0.0) == 10.0
    assert decayed_growth_rate(10.0, GROWTH_WINDOW_S) == pytest.approx(5.0)
    assert decayed_growth_rate(10.0, 9 * GROWTH_WINDOW_S) == pytest.approx(1.0)


def test_runway_is_the_headroom_over_the_rate(config: Config) -> None:
    r = runway(session(), config, T0)
    assert r is not None
    assert (r.seconds, r.tokens, r.window, r.rate_per_s) == (200.0, 8_000, 10_000, 10.0)
    # A window of the session's idle time later, the rate has halved and the runway doubled.
    later = runway(session(), config, T0 + dt.timedelta(seconds=GROWTH_WINDOW_S))
    assert later is not None and later.seconds == pytest.approx(400.0)


def test_runway_counts_the_envelope_and_a_larger_provider_report(config: Config) -> None:
    r = runway(session(envelope_tokens=500), config, T0)
    assert r is not None and r.seconds == pytest.approx(150.0)
    reported = session(reported_input_tokens=9_000, reported_output_tokens=0,
                       reported_base_tokens=8_000, reported_version=1)
    r = runway(reported, config, T0)
    assert r is not None and (r.tokens, r.seconds) == (9_000, pytest.approx(100.0))


def test_a_session_past_its_window_has_no_runway_left(config: Config) -> None:
    r = runway(session(surface_tokens=12_000), config, T0)
    assert r is not None and r.seconds == 0.0


def test_no_runway_without_growth_or_without_a_window(config: Config) -> None:
    assert runway(session(growth_rate=0.0), config, T0) is None
    assert runway(session(context_window=None, run_model="no-such-model"), config, T0) is None


def test_sessions_are_listed_least_runway_first(config: Config) -> None:
    infos = [session("slow", growth_rate=1.0), session("idle", growth_rate=0.0),
             session("fast", growth_rate=40.0), session("mid", growth_rate=10.0)]
    assert [r.session for r in sorted_runways(infos, config, T0)] == ["fast", "mid", "slow"]
