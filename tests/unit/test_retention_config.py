"""``retention:``: a positive number of days or nothing, refused at load naming the key; the
beat runs the purge as often as ``interval_s`` says (always: expired append idempotency keys
are purged whatever else is set)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from compactd.storage.errors import ConfigError
from compactd.worker.app import celery_settings
from compactd.worker.keys import TASK_RETENTION
from compactd.worker.settings import Settings, build_config, load_config

SETTINGS = Settings(database_url="sqlite:///x.sqlite3", broker_url="memory://")


@pytest.mark.parametrize("key", ["originals_days", "sessions_idle_days", "interval_s",
                                 "append_keys_hours"])
@pytest.mark.parametrize("value", [0, -1, -0.5, "30", "thirty", True, float("inf"),
                                   float("nan"), [1], {"days": 1}])
def test_a_retention_that_is_not_a_positive_number_names_its_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^retention\.{key}: "):
        build_config({"retention": {key: value}}, settings=SETTINGS)


def test_an_unknown_retention_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^retention\.originals: unknown key"):
        build_config({"retention": {"originals": 3}}, settings=SETTINGS)


def test_append_keys_hours_is_at_most_30_days() -> None:
    assert build_config({"retention": {"append_keys_hours": 720}},
                        settings=SETTINGS).retention.append_key_window_s == 720 * 3600
    with pytest.raises(ConfigError, match=r"^retention\.append_keys_hours: "):
        build_config({"retention": {"append_keys_hours": 721}}, settings=SETTINGS)


@pytest.mark.parametrize(("retention", "scheduled"), [
    ({}, 3600.0),
    ({"interval_s": 60}, 60.0),
    ({"originals_days": 30}, 3600.0),
    ({"sessions_idle_days": 0.5, "interval_s": 120}, 120.0),
])
def test_the_beat_runs_the_purge_as_often_as_interval_s_says(
        retention: dict[str, Any], scheduled: float) -> None:
    config = build_config({"retention": retention}, settings=SETTINGS)
    entry = celery_settings(config)["beat_schedule"]["retention"]
    assert entry["task"] == TASK_RETENTION and entry["schedule"] == scheduled
    assert celery_settings(config)["task_routes"][TASK_RETENTION] == {
        "queue": "compaction.housekeeping"}


def test_the_example_config_shows_every_retention_key() -> None:
    example = Path(__file__).resolve().parents[2] / "ops" / "compactd.example.yaml"
    retention = load_config({}, path=str(example)).retention
    assert (retention.originals_days, retention.sessions_idle_days, retention.interval_s,
            retention.append_keys_hours) == (90, 365, 3600, 24)
