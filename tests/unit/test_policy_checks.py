"""Policy values that must mean what they say: the keep override's one reader, keep against the
trigger, prune settings, clearing's own trigger and fractions without a window (no I/O)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from storage.messages import Message
from worker.compaction.policy import (
    ANY_WINDOW,
    PRUNE_MARKER,
    Clause,
    Policy,
    PolicyError,
    keep_refires,
    parse_clause,
    parse_keep_text,
    parse_policy,
    parse_trigger,
)
from worker.compaction.pruning import cut_middle, prune_message


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


@pytest.mark.parametrize(("raw", "window", "refused"), [
    # defaults: fraction 0.8 against retain_ratio 0.16, or the last 20 messages without a window
    ({}, None, False),
    ({}, ANY_WINDOW, False),
    ({"retain_ratio": 0.9}, ANY_WINDOW, True),
    ({"retain_ratio": 0.9}, None, False),  # without a window the fraction trigger is dropped
    ({"trigger": ["fraction", 0.1]}, ANY_WINDOW, True),
    ({"trigger": ["messages", 15]}, None, True),
    ({"trigger": ["messages", 15]}, 128_000, False),  # retain_ratio is tokens, not messages
    # explicit keep against a fraction, only decidable with the window
    ({"trigger": ["fraction", 0.5], "keep": ["tokens", 600]}, ANY_WINDOW, False),
    ({"trigger": ["fraction", 0.5], "keep": ["tokens", 600]}, 1000, True),
    ({"trigger": ["fraction", 0.5], "keep": ["tokens", 600]}, 2000, False),
    ({"trigger": ["tokens", 30_000]}, 128_000, False),  # 0.16 x 128k = 20480 is below
    ({"trigger": ["tokens", 20_000]}, 128_000, True),
    ({"trigger": ["tokens", 5000], "keep": ["fraction", 0.3]}, 10_000, False),
    ({"trigger": ["tokens", 5000], "keep": ["fraction", 0.5]}, 10_000, True),
    # an AND group fires again only when the tail meets every clause
    ({"trigger": {"tokens": 100_000_000, "messages": 2}, "keep": ["messages", 2]}, None, False),
    ({"trigger": {"tokens": 500, "fraction": 0.5}, "keep": ["tokens", 600]}, 1000, True),
    ({"trigger": {"tokens": 500, "fraction": 0.5}, "keep": ["tokens", 600]}, 2000, False),
    ({"trigger": {"tokens": 1000, "fraction": 0.5}, "keep": ["tokens", 600]}, 1000, False),
    # OR: one group met is enough
    ({"trigger": [["tokens", 100_000], ["messages", 10]], "keep": ["messages", 12]}, None, True),
])
def test_keep_refires(raw: dict[str, Any], window: int | None, refused: bool) -> None:
    assert (keep_refires(_unchecked(raw), window) is not None) is refused


def _unchecked(raw: dict[str, Any]) -> Policy:
    """The policy ``raw`` says, without the load check (which would refuse some of them)."""
    policy = Policy()
    if "trigger" in raw:
        policy = replace(policy, trigger=parse_trigger(raw["trigger"], "trigger"))
    if "keep" in raw:
        policy = replace(policy, keep=parse_clause(raw["keep"], "keep"))
    return replace(policy, retain_ratio=raw.get("retain_ratio", policy.retain_ratio))


@pytest.mark.parametrize(("raw", "says"), [
    # 60 + 39 + the 39-character marker is 138 code points: longer than the threshold.
    ({"threshold_chars": 100, "head_chars": 60, "tail_chars": 39},
     "the 39-character marker (138) must be below threshold_chars (100)"),
    ({"threshold_chars": 100, "head_chars": 30, "tail_chars": 31},
     "the 39-character marker (100) must be below threshold_chars (100)"),
    ({"head_chars": 0, "tail_chars": 0}, "cannot both be 0"),
    ({"head_chars": -1}, "must be non-negative"),
    ({"threshold_chars": 0}, "must be positive"),
])
def test_prune_settings_refused(raw: dict[str, Any], says: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy({"prune": raw})
    assert err.value.path.startswith("summarization.prune") and says in str(err.value), err.value


@pytest.mark.parametrize(("raw", "content", "pruned"), [
    ({"threshold_chars": 100, "head_chars": 0, "tail_chars": 20},
     "x" * 100 + "END OF THE BUILD LOG", PRUNE_MARKER + "END OF THE BUILD LOG"),
    ({"threshold_chars": 100, "head_chars": 12, "tail_chars": 0},
     "HEAD OF FILE" + "x" * 100, "HEAD OF FILE" + PRUNE_MARKER),
    ({"threshold_chars": 100, "head_chars": 30, "tail_chars": 30},
     "a" * 30 + "x" * 41 + "b" * 30, "a" * 30 + PRUNE_MARKER + "b" * 30),
    # At the threshold nothing is pruned.
    ({"threshold_chars": 100, "head_chars": 30, "tail_chars": 30}, "a" * 100, None),
])
def test_prune_keeps_what_it_says(raw: dict[str, Any], content: str, pruned: str | None) -> None:
    config = parse_policy({"prune": raw}).prune
    out = prune_message(Message(role="tool", content=content, tool_call_id="c1"), config)
    assert (out.content if out else None) == pruned
    if out is not None:
        assert isinstance(out.content, str) and len(out.content) < config.threshold_chars


def test_tail_only_pruning_of_blocks_keeps_the_image_and_the_end() -> None:
    blocks = [{"type": "image", "source": "i1"}, {"type": "text", "text": "x" * 200},
              {"type": "text", "text": "the end"}]
    assert cut_middle(blocks, 0, 10) == [
        {"type": "image", "source": "i1"}, {"type": "text", "text": PRUNE_MARKER + "xxx"},
        {"type": "text", "text": "the end"}]
