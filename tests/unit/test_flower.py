"""Flower's defaults (worker.flower) on Tornado options shaped like Flower's own."""

from __future__ import annotations

import pytest
from tornado.options import OptionParser

from compactd.worker.flower import (
    ENV_UNAUTHENTICATED,
    TASK_COLUMNS,
    FlowerUnauthenticated,
    apply_defaults,
)

FLOWER_COLUMNS = "name,uuid,state,received,runtime,worker"


def flower_options(*argv: str) -> OptionParser:
    options = OptionParser()
    options.define("basic_auth", type=str, default=None, multiple=True)
    options.define("auth", default="", type=str)
    options.define("tasks_columns", type=str, default=FLOWER_COLUMNS)
    options.parse_command_line(["flower", *argv])
    return options


def test_refuses_without_authentication(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FlowerUnauthenticated) as caught:
        apply_defaults(flower_options(), env={})
    assert caught.value.code == 2
    assert "FLOWER_BASIC_AUTH=user:password" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [("--basic_auth=ops:pw",), ("--basic_auth=a:1,b:2",),
                                  ("--auth=.*@example\\.com",)])
def test_basic_auth_or_oauth_is_enough(argv: tuple[str, ...]) -> None:
    options = flower_options(*argv)
    apply_defaults(options, env={})
    assert options.tasks_columns == TASK_COLUMNS


@pytest.mark.parametrize("value, allowed", [("1", True), ("true", True), ("yes", True),
                                            ("0", False), ("", False), ("no", False)])
def test_only_an_explicit_opt_out_runs_it_open(value: str, allowed: bool) -> None:
    options = flower_options()
    if allowed:
        apply_defaults(options, env={ENV_UNAUTHENTICATED: value})
    else:
        with pytest.raises(FlowerUnauthenticated):
            apply_defaults(options, env={ENV_UNAUTHENTICATED: value})


def test_columns_set_by_the_operator_are_kept() -> None:
    options = flower_options("--basic_auth=ops:pw", "--tasks_columns=name,state")
    apply_defaults(options, env={})
    assert options.tasks_columns == "name,state"


def test_the_columns_name_real_flower_columns() -> None:
    from flower.views.tasks import TASK_COLUMNS as FLOWER_KNOWN

    assert set(TASK_COLUMNS.split(",")) <= set(FLOWER_KNOWN)
    assert {"exception", "kwargs"} <= set(TASK_COLUMNS.split(","))


def test_the_app_sends_the_events_flower_needs() -> None:
    from compactd.worker.app import celery_settings
    from compactd.worker.settings import load_config

    settings = celery_settings(load_config({"COMPACTD_BROKER_URL": "redis://127.0.0.1:9/0"}))
    assert settings["worker_send_task_events"] is True  # received, started, failed, ...
    assert settings["task_send_sent_event"] is True  # sent, by whoever enqueues
    assert settings["event_serializer"] == "json"


@pytest.mark.parametrize("entry", [":", "ops:", ":pw", "ops", "ops:pw,:"])
def test_an_entry_with_an_empty_user_or_password_is_refused_even_with_the_opt_out(
        entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    for env in ({}, {ENV_UNAUTHENTICATED: "1"}):
        with pytest.raises(FlowerUnauthenticated) as caught:
            apply_defaults(flower_options(f"--basic_auth={entry}"), env=env)
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert "empty user or password" in err
        assert f"entry {2 if entry.startswith('ops:pw,') else 1}" in err
        assert "pw" not in err.replace("password", "")
