"""Which event a run's end is (``storage.events.run_end_event``), the one builder the failed
run's NOTIFY and the webhooks share."""

from __future__ import annotations

import dataclasses
import json

import pytest

from compactd.storage.events import (
    COMMIT_ROW_FIELDS,
    Event,
    EventKind,
    commit_event_fields,
    run_end_event,
)
from compactd.storage.kinds import FailureClass, RunStatus


@pytest.mark.parametrize(("status", "failure_class", "kind", "outcome"), [
    (RunStatus.COMMITTED, None, EventKind.COMMITTED, "committed"),
    (RunStatus.FAILED, FailureClass.SUMMARY, EventKind.FAILED, "summary"),
    (RunStatus.FAILED, None, EventKind.FAILED, "failed"),
    (RunStatus.FAILED, FailureClass.BUSY, None, None),  # contention, not an event
    (RunStatus.NOTHING_TO_DO, None, None, None),
])
def test_a_run_s_end_is_committed_failed_or_no_event(
        status: str, failure_class: str | None, kind: EventKind | None,
        outcome: str | None) -> None:
    event = run_end_event("s1", "acme", "r1", version=7, seq=42, status=status,
                          failure_class=failure_class)
    if kind is None:
        assert event is None
        return
    assert event is not None
    assert event.to_json() == {"event": kind, "session": "s1", "tenant": "acme", "run_id": "r1",
                               "version": 7, "seq": 42, "outcome": outcome}


def test_the_commit_s_statement_is_given_every_field_it_does_not_fill_from_its_row() -> None:
    # What queries.sql's commit adds from its row and what storage.events builds for it are
    # together every field of an event, each once.
    built = json.loads(commit_event_fields("s1", "r1", RunStatus.RUNNING))
    assert built == {"event": EventKind.COMMITTED, "session": "s1", "run_id": "r1",
                     "outcome": "running"}
    assert sorted([*built, *COMMIT_ROW_FIELDS]) == sorted(
        f.name for f in dataclasses.fields(Event))
