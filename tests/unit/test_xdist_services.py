"""Each pytest-xdist worker gets a PostgreSQL database and a Redis database of its own (two
workers sharing one would drop, truncate and flush each other's data, and their Celery workers
would take each other's tasks)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.conftest import REPO, worker_database_url, worker_redis_url
from tests.support.services import APT_DONE_ENV, debian_packages_settled

PG = "postgresql://postgres@127.0.0.1:5432/compactd_test"
REDIS = "redis://127.0.0.1:6379/15"


def test_without_xdist_the_given_services_are_used() -> None:
    assert worker_database_url(PG, "") == PG
    assert worker_redis_url(REDIS, "") == REDIS


def test_each_worker_has_its_own_database_on_the_same_server() -> None:
    urls = [worker_database_url(PG, f"gw{i}") for i in range(3)]
    assert urls == ["postgresql://postgres@127.0.0.1:5432/compactd_test_gw0",
                    "postgresql://postgres@127.0.0.1:5432/compactd_test_gw1",
                    "postgresql://postgres@127.0.0.1:5432/compactd_test_gw2"]


def test_each_worker_has_its_own_redis_database_counting_down_from_the_given_one() -> None:
    assert [worker_redis_url(REDIS, f"gw{i}") for i in range(3)] == [
        "redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379/14", "redis://127.0.0.1:6379/13"]
    assert worker_redis_url("redis://:pw@10.0.0.5:6380/6", "gw1") == "redis://:pw@10.0.0.5:6380/5"


def test_a_redis_database_too_low_for_the_worker_count_is_refused_by_name() -> None:
    assert worker_redis_url("redis://127.0.0.1:6379/1", "gw1") == "redis://127.0.0.1:6379/0"
    with pytest.raises(pytest.UsageError, match="Redis database 1, too low for xdist worker gw2"):
        worker_redis_url("redis://127.0.0.1:6379/1", "gw2")
    with pytest.raises(pytest.UsageError, match="Redis database 0, too low for xdist worker gw1"):
        worker_redis_url("redis://127.0.0.1:6379", "gw1")


def test_a_test_needing_a_debian_package_waits_for_ops_tests_background_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ops/test names the file its background apt-get creates when it ends.
    assert f"export {APT_DONE_ENV}" in (REPO / "ops" / "test").read_text()
    marker = tmp_path / "apt-done"
    monkeypatch.setenv(APT_DONE_ENV, str(marker))
    threading.Timer(0.3, marker.touch).start()
    debian_packages_settled(timeout_s=30)
    assert marker.exists()
