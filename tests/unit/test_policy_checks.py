"""Policy values that must mean what they say: the keep override's one reader, keep against the
trigger, prune settings, clearing's own trigger and fractions without a window (no I/O)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from compactd.storage.messages import Message
from compactd.storage.records import SessionInfo
from compactd.worker.compaction.policy import (
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
from compactd.worker.compaction.pruning import cut_middle, prune_message

NOW_UTC = datetime(2026, 12, 1, tzinfo=UTC)


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


def _abandoned_call() -> list[Any]:
    """A call the runtime never answered, then 30 messages of later turns."""
    from tests.support.surfaces import ai, nodes, sys, user

    messages = [sys(), user("fix it"), ai(None, ("lost", "read_file"))]
    for i in range(15):
        messages += [user(f"question {i} " * 30), ai(f"answer {i} " * 30)]
    return nodes(*messages)


@pytest.mark.parametrize(("force", "keep"), [(True, None), (False, None),
                                             (True, Clause("messages", 4))])
def test_an_open_call_pins_only_itself(force: bool, keep: Clause | None) -> None:
    from compactd.worker.compaction.planner import plan
    from tests.support.surfaces import NOW

    surface = _abandoned_call()
    policy = Policy(trigger=((Clause("tokens", 500),),), keep=Clause("messages", 6))
    step = plan(surface, policy=policy, now=NOW, force=force, keep_override=keep).summarize
    assert step is not None
    # The call stays (its result may still come, after everything); the later turns go.
    assert 3 not in step.replace_seqs and step.replace_seqs[0] == 4
    assert len(step.replace_seqs) >= 20


def test_an_open_call_answered_in_part_keeps_its_results() -> None:
    from compactd.worker.compaction.planner import plan
    from tests.support.surfaces import NOW, ai, nodes, sys, tool, user

    messages = [sys(), user("go"), ai(None, ("a", "bash"), ("b", "bash")), user("x " * 50),
                tool("a", "result " * 50)]
    messages += [ai(f"later {i} " * 40) for i in range(8)]
    surface = nodes(*messages)
    policy = Policy(trigger=((Clause("tokens", 100),),), keep=Clause("messages", 2))
    step = plan(surface, policy=policy, now=NOW).summarize
    assert step is not None and step.replace_seqs[0] == 6  # after the group's result (seq 5)
    # The step still waiting for its last result, with nothing else after it, is the newest
    # step: forced mode keeps it whole and takes what came before.
    waiting = nodes(sys(), user("old task " * 60), ai("ok " * 40), user("go"),
                    ai(None, ("a", "bash"), ("b", "bash")), tool("a", "result " * 50))
    step = plan(waiting, policy=policy, now=NOW, force=True).summarize
    assert step is not None and step.replace_seqs == (2, 3)


def _tool_steps(count: int, size: int) -> list[Any]:
    from tests.support.surfaces import ai, nodes, sys, tool, user

    messages = [sys(), user("go")]
    for i in range(count):
        messages += [ai(None, (f"c{i}", "bash")), tool(f"c{i}", f"output {i} " * size)]
    return nodes(*messages)


@pytest.mark.parametrize(("clear_trigger", "cleared"), [(100, 3), (100_000, 0)])
def test_clearing_fires_on_its_own_trigger(clear_trigger: int, cleared: int) -> None:
    from compactd.worker.compaction.planner import plan
    from compactd.worker.compaction.triggers import should_run
    from tests.support.surfaces import NOW

    policy = parse_policy({"trigger": ["tokens", 1_000_000], "keep": ["messages", 6],
                           "prune": {"threshold_chars": 300, "head_chars": 100,
                                     "tail_chars": 100},
                           "clear_tool_uses": {"enabled": True, "trigger": clear_trigger,
                                               "keep": 1}})
    result = plan(_tool_steps(4, 60), policy=policy, now=NOW)
    assert not result.fired and result.summarize is None
    # Clearing only: no size pruning (the summary trigger's layer) and no summary.
    assert [a.edits for a in result.prune] == [("clear",)] * cleared
    assert should_run(result.pressure, policy)[0] is bool(cleared)
    off = parse_policy({**policy.to_config(), "enabled": False})
    assert plan(_tool_steps(4, 60), policy=off, now=NOW).prune == ()


@pytest.mark.parametrize(("raw", "window", "says"), [
    ({}, None, "dropped fraction>=0.8; automatic compaction is OFF"),
    ({"trigger": [["fraction", 0.5], ["tokens", 9000]]}, None, "dropped fraction>=0.5"),
    ({}, 128_000, None),
    ({"trigger": ["tokens", 9000]}, None, None),
])
def test_fraction_without_a_window_warns(raw: dict[str, Any], window: int | None,
                                         says: str | None) -> None:
    warnings = parse_policy(raw).resolve(window).warnings()
    if says is None:
        assert warnings == ()
    else:
        assert len(warnings) == 1 and says in warnings[0]
        assert ("OFF" in warnings[0]) is ("tokens" not in str(raw))


def test_a_stored_override_stays_readable_when_the_configuration_changes() -> None:
    from compactd.worker.pressure import session_policy
    from compactd.worker.settings import build_config

    # Checked and stored when the configuration triggered at 20000 tokens; the operator then
    # lowered the trigger below the session's keep. Sweeps and runs still read the session.
    config = build_config({"summarization": {"trigger": ["tokens", 2000],
                                             "keep": ["messages", 6]}})
    info = SessionInfo(
        id="s1", tenant="default", run_model=None, context_window=None, envelope=None,
        envelope_tokens=0, policy={"keep": ["tokens", 5000]}, surface_version=1,
        surface_tokens=0, surface_messages=0, last_seq=0, last_position=0,
        reported_input_tokens=None, reported_output_tokens=None, reported_base_tokens=None,
        reported_version=None, signal_at=None, lease_owner=None,
        lease_run_id=None, lease_expires_at=None, lease_fence=0, cooldown_until=None,
        flagged_reason=None, flagged_at=None, created_at=NOW_UTC, last_append_at=None)
    assert session_policy(info, config).keep == Clause("tokens", 5000)
