"""The scheduler's input parsing and its configuration keys, as tables: rates, durations, signal
payloads, bulk filters, and the worker keys that drive beat's schedule and the leases."""

from __future__ import annotations

import argparse
import math

import pytest

from compactd.scheduler.args import parse_duration
from compactd.scheduler.bulk import BulkFilter
from compactd.scheduler.intake import parse_signal
from compactd.storage.errors import ConfigError, InvalidMessage
from compactd.worker.app import celery_settings
from compactd.worker.keys import TASK_REAP, TASK_RETENTION, TASK_SWEEP
from compactd.worker.limits import parse_rate
from compactd.worker.settings import Settings, build_config


@pytest.mark.parametrize(("text", "expected"), [
    ("20/s", 20.0),
    ("50/s", 50.0),
    (" 50 / s ", 50.0),
    ("20", 20.0),
    ("0.5/s", 0.5),
    ("600/m", 10.0),
    ("600/min", 10.0),
    ("3600/h", 1.0),
    ("7200/hour", 2.0),
    ("20/SEC", 20.0),
])
def test_parse_rate(text: str, expected: float) -> None:
    assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize(("text", "error"), [
    ("0/s", "positive"),
    ("-5/s", "positive"),
    ("nan/s", "positive"),
    ("inf", "positive"),
    ("1e400/s", "positive"),
    ("fast/s", "not a rate"),
    ("", "not a rate"),
    ("20/d", "unknown rate unit"),
    ("20/", "unknown rate unit"),
])
def test_parse_rate_refuses(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_rate(text)


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("90", 90), ("30m", 1800), ("30min", 1800), (" 1h ", 3600), ("1.5h", 5400),
    ("2d", 172_800), ("2day", 172_800), ("10 sec", 10), ("1HR", 3600), ("0s", 0),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "-1h", "1w", "1h30m", "soon", "1.2.3s"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(InvalidMessage, match="not a duration"):
        parse_duration(text)


def test_parse_signal_defaults_to_pressure() -> None:
    payload = parse_signal({"session": "s1"})
    assert (payload.session, payload.reason) == ("s1", "pressure")
    assert parse_signal({"session": "s1", "reason": "step"}).reason == "step"


@pytest.mark.parametrize(("raw", "field", "reason"), [
    ({"session": "s1", "reason": "panic"}, "reason", "'pressure', 'step' or 'append'"),
    ({"session": ""}, "session", "at least 1 character"),
    ({"session": "x" * 256}, "session", "at most 255 characters"),
    ({"session": 12}, "session", "valid string"),
    ({}, "session", "required"),
    ({"session": "s1", "urgent": True}, "urgent", "unknown key"),
    (["s1"], None, "must be a mapping of keys"),
])
def test_parse_signal_names_the_bad_field(raw: object, field: str | None, reason: str) -> None:
    with pytest.raises(InvalidMessage, match=reason) as info:
        parse_signal(raw)
    assert info.value.field == field


def _filter_args(**over: object) -> argparse.Namespace:
    base: dict[str, object] = {"tenant": None, "run_model": None, "min_tokens": None,
                               "idle_for": None, "session_file": None}
    return argparse.Namespace(**{**base, **over})


def test_bulk_filter_from_args() -> None:
    f = BulkFilter.from_args(_filter_args(tenant="acme", min_tokens=5000, idle_for="1h"))
    assert f == BulkFilter(tenant="acme", min_tokens=5000, idle_for_s=3600.0)
    assert f.to_json() == {"tenant": "acme", "min_tokens": 5000, "idle_for_s": 3600.0}
    assert BulkFilter.from_args(_filter_args()).to_json() == {}


@pytest.mark.parametrize(("over", "match"), [
    ({"min_tokens": -1}, "non-negative"),
    ({"idle_for": "a while"}, "not a duration"),
])
def test_bulk_filter_refuses(over: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidMessage, match=match):
        BulkFilter.from_args(_filter_args(**over))


def _config(worker: dict[str, object]):  # type: ignore[no-untyped-def]
    return build_config({"worker": worker},
                        settings=Settings(database_url="sqlite:///unused.sqlite3",
                                          broker_url="redis://127.0.0.1:6379/0"))


def test_sweep_and_reap_intervals_drive_the_beat_schedule() -> None:
    config = _config({"sweep_interval_s": 2.5, "reap_interval_s": 0.75})
    schedule = celery_settings(config)["beat_schedule"]
    by_task = {entry["task"]: entry for entry in schedule.values()}
    # Retention's purge runs too (expired append idempotency keys), on its own interval.
    assert set(by_task) == {TASK_SWEEP, TASK_REAP, TASK_RETENTION}
    assert by_task[TASK_RETENTION]["schedule"] == 3600.0
    assert by_task[TASK_SWEEP]["schedule"] == 2.5
    assert by_task[TASK_REAP]["schedule"] == 0.75
    # A tick that could not run within its interval is dropped, not piled up behind the next.
    assert by_task[TASK_SWEEP]["options"]["expires"] == 2.5
    assert by_task[TASK_REAP]["options"]["expires"] == 0.75


def test_default_intervals() -> None:
    w = _config({}).worker
    assert (w.sweep_interval_s, w.reap_interval_s, w.lease_s) == (30.0, 15.0, 60.0)
    assert (w.loop_guard.max_compactions, w.loop_guard.window_s, w.loop_guard.margin,
            w.loop_guard.cooldown_s) == (3, 600.0, 0.1, 900.0)


def test_lease_and_loop_guard_are_config_keys() -> None:
    w = _config({"lease_s": 1.5, "signal_ttl_s": 4, "sweep_batch": 7,
                 "loop_guard": {"max_compactions": 2, "window_s": 30, "margin": 0.25,
                                "cooldown_s": 5}}).worker
    assert (w.lease_s, w.signal_ttl_s, w.sweep_batch) == (1.5, 4.0, 7)
    assert (w.loop_guard.max_compactions, w.loop_guard.window_s, w.loop_guard.margin,
            w.loop_guard.cooldown_s) == (2, 30.0, 0.25, 5.0)


@pytest.mark.parametrize(("worker", "path"), [
    ({"sweep_interval_s": 0}, "worker.sweep_interval_s"),
    ({"reap_interval_s": -1}, "worker.reap_interval_s"),
    ({"lease_s": math.inf}, "worker.lease_s"),
    ({"loop_guard": {"max_compactions": 0}}, "worker.loop_guard.max_compactions"),
    ({"loop_guard": {"margin": 1.0}}, "worker.loop_guard.margin"),
    ({"loop_guard": {"window": 60}}, "worker.loop_guard.window"),
    ({"sweep_every": 5}, "worker.sweep_every"),
])
def test_bad_scheduler_keys_name_their_path(worker: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        _config(worker)
