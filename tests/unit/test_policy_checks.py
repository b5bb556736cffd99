"""Policy values that must mean what they say: the keep override's one reader, keep against the
trigger, prune settings, clearing's own trigger and fractions without a window (no I/O)."""

from __future__ import annotations

import pytest

from worker.compaction.policy import Clause, PolicyError, parse_keep_text


@pytest.mark.parametrize(("text", "clause"), [
    ("messages:12", Clause("messages", 12)),
    ("tokens:3000", Clause("tokens", 3000)),
    ("tokens:1e6", Clause("tokens", 1_000_000)),
    ("fraction:0.25", Clause("fraction", 0.25)),
    ("fraction:1", Clause("fraction", 1.0)),
])
def test_keep_text_parses(text: str, clause: Clause) -> None:
    parsed = parse_keep_text(text)
    assert parsed == clause
    # What the CLI and the API send to the worker reads back to the same clause.
    assert parse_keep_text(parsed.to_text()) == parsed


@pytest.mark.parametrize(("text", "says"), [
    ("messages", "expected KIND:N"),
    ("messages:", "number after the colon"),
    ("messages:twelve", "number after the colon"),
    ("pages:3", "unknown kind 'pages'"),
    ("messages:2.5", "must be an integer"),
    ("messages:0", "must be positive"),
    ("tokens:-4", "must be positive"),
    ("tokens:nan", "finite"),
    ("fraction:30", "write 0.3"),
])
def test_keep_text_refuses(text: str, says: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_keep_text(text, "--keep")
    assert str(err.value).startswith("--keep: ") and says in str(err.value), str(err.value)


def test_large_counts_survive_the_text_form() -> None:
    # ``:g`` wrote 1234567 as 1.23457e+06, a different keep than the one asked for.
    assert Clause("tokens", 1_234_567).to_text() == "tokens:1234567"
