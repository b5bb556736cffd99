"""The local summarizer on generated sessions: sections, size, and the facts it must keep."""

from __future__ import annotations

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.messages import Message, parse_openai
from compactd.storage.tokens import counter_for
from compactd.worker.llm.errors import LocalSummaryError
from compactd.worker.llm.local import (
    SECTIONS,
    find_exception_names,
    find_paths,
    parse_sections,
    summarize_local,
    summarize_local_index,
    tool_result_facts,
)

COUNTER = counter_for(None)


def session(steps: int, seed: int) -> tuple[list[Message], dict[str, list[str]]]:
    sample = coding_session(steps=steps, seed=seed)
    return [parse_openai(m) for m in sample.messages], sample.facts


def input_tokens(messages: list[Message], existing: str | None = None) -> int:
    return (sum(COUNTER.count_message(m) for m in messages)
            + (COUNTER.count_text(existing) if existing else 0))


@pytest.mark.parametrize(("steps", "seed"), [(5, 1), (12, 2), (40, 7), (80, 11), (200, 13)])
def test_generated_sessions(steps: int, seed: int) -> None:
    messages, facts = session(steps, seed)
    summary = summarize_local(messages, max_tokens=2000)
    for heading in SECTIONS:
        assert f"## {heading}\n" in summary
    assert COUNTER.count_text(summary) < input_tokens(messages)
    assert COUNTER.count_text(summary) <= 2000
    paths, errors = tool_result_facts(messages)
    assert paths and errors
    assert [p for p in paths if p not in summary] == []
    assert [e for e in errors if e not in summary] == []
    # The planted facts of the generator, checked independently of the summarizer's finders.
    for fact in facts["paths"] + facts["errors"] + facts["ids"][:1]:
        assert fact in summary
    assert summarize_local(messages, max_tokens=2000) == summary  # deterministic


def test_sections_say_none_when_empty_and_the_request_comes_first() -> None:
    messages = [Message(role="user", content="Please rename the column total_cents in the "
                        "ledger table to amount_cents and keep a migration. " * 8),
                Message(role="assistant", content="I will write the migration next.")]
    summary = summarize_local(messages, max_tokens=500)
    parsed = parse_sections(summary)
    assert parsed is not None and list(parsed) == list(SECTIONS)
    assert parsed["Primary Request and Intent"][0].startswith("Please rename the column")
    assert parsed["Errors and Fixes"] == []
    assert "## Errors and Fixes\n(none)" in summary
    assert parsed["Next Step"] == ["I will write the migration next."]


def test_errors_record_their_line_and_what_followed() -> None:
    messages, _ = session(12, 2)
    summary = summarize_local(messages, max_tokens=2000)
    errors = parse_sections(summary)["Errors and Fixes"]  # type: ignore[index]
    line = next(e for e in errors if e.startswith("InvoiceMismatchError") or
                e.startswith("LedgerImbalanceError"))
    assert "expected 1042.50 got 1042.49" in line
    assert "then: edited" in line


@pytest.mark.parametrize("max_tokens", [150, 250, 400])
def test_a_small_budget_is_respected_and_keeps_must_keep_facts_first(max_tokens: int) -> None:
    messages, _ = session(40, 7)
    summary = summarize_local(messages, max_tokens=max_tokens)
    assert COUNTER.count_text(summary) <= max_tokens
    assert all(f"## {h}" in summary for h in SECTIONS)
    paths, errors = tool_result_facts(messages)
    # Exceptions are few and go first; paths are kept from the earliest, so the first is in.
    assert [e for e in errors if e not in summary] == []
    assert paths[0] in summary
    assert sum(p in summary for p in paths) >= min(len(paths), 5)


def test_never_longer_than_a_small_input() -> None:
    messages = [Message(role="user", content="Fix src/app/main.py please, it raises KeyError "
                        "on start. " * 12),
                Message(role="assistant", content="Looking."),
                Message(role="tool", tool_call_id="c1",
                        content="Traceback:\n  File \"src/app/main.py\", line 3\nKeyError: 'x'")]
    summary = summarize_local(messages, max_tokens=2000)
    assert COUNTER.count_text(summary) < input_tokens(messages)
    assert "src/app/main.py" in summary and "KeyError" in summary


def test_an_input_too_small_for_eight_sections_is_refused() -> None:
    with pytest.raises(LocalSummaryError, match="eight empty sections"):
        summarize_local([Message(role="user", content="hi")], max_tokens=2000)
    # Room for the headings but not for any content: refused, not eight "(none)".
    with pytest.raises(LocalSummaryError, match="no room for any content"):
        summarize_local([Message(role="user", content="Please rename the ledger column "
                                 "total_cents to amount_cents, and keep a migration. " * 4)],
                        max_tokens=2000)


def test_an_existing_summary_is_merged_not_copied() -> None:
    messages, _ = session(20, 3)
    half = len(messages) // 2
    first = summarize_local(messages[:half], max_tokens=1200)
    merged = summarize_local(messages[half:], existing_summary=first, max_tokens=1200)
    assert COUNTER.count_text(merged) < input_tokens(messages[half:], first)
    paths, errors = tool_result_facts(messages)
    assert [f for f in paths + errors if f not in merged] == []
    sections = parse_sections(merged)
    assert sections is not None
    # One "tools used" line with the counts added up, not one per summary.
    tools = [i for i in sections["Key Technical Concepts"] if i.startswith("tools used:")]
    assert len(tools) == 1
    # The older summary's current work is replaced by the newer one.
    assert sections["Current Work"] == parse_sections(
        summarize_local(messages[half:], max_tokens=1200))["Current Work"]  # type: ignore[index]
    # Each path is listed once.
    files = sections["Files and Code"]
    assert len(files) == len({find_paths(line)[0] for line in files})


def test_a_free_text_summary_is_kept_with_its_facts() -> None:
    messages, _ = session(5, 4)
    earlier = ("We were chasing a PaymentGatewayError in services/pay/gateway.py; the user wants "
               "retries capped at 3.")
    merged = summarize_local(messages, existing_summary=earlier, max_tokens=2000)
    assert "services/pay/gateway.py" in merged and "PaymentGatewayError" in merged
    assert "retries capped at 3" in merged


def test_a_checkpoint_among_the_messages_counts_as_the_existing_summary() -> None:
    messages, _ = session(10, 5)
    first = summarize_local(messages[:15], max_tokens=800)
    checkpoint = Message(role="user", content="<durable_context_data>...</durable_context_data>",
                         meta={"checkpoint": True, "summary": first})
    merged = summarize_local([checkpoint, *messages[15:]], max_tokens=800)
    paths, errors = tool_result_facts(messages)
    assert [f for f in paths + errors if f not in merged] == []


@pytest.mark.parametrize(("text", "expected"), [
    ('File "/repo/src/billing/tax.py", line 12', ["/repo/src/billing/tax.py"]),
    ("[File: src/core/ledger.py (220 lines total)]", ["src/core/ledger.py"]),
    ("tests/test_tax.py::test_case_001 PASSED", ["tests/test_tax.py"]),
    ("see setup.py and README.md.", ["setup.py", "README.md"]),
    ("cd /testbed/src && ls ~/notes/today.txt", ["/testbed/src", "~/notes/today.txt"]),
    ("os.path.join and self.assertEqual are not files", []),
    ("https://github.com/org/repo/blob/main/setup.py is a URL", []),
    ("1/2 and 2026/11/30 and and/or are not paths; v1.2.3 neither", []),
    ("a/src/marshmallow/fields.py b/src/marshmallow/fields.py",
     ["a/src/marshmallow/fields.py", "b/src/marshmallow/fields.py"]),
])
def test_find_paths(text: str, expected: list[str]) -> None:
    assert find_paths(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("KeyError: 'amount'", ["KeyError"]),
    ("raise marshmallow.exceptions.ValidationError('x')", ["ValidationError"]),
    ("E   AssertionError: 1 != 2\nDuring handling, ValueError", ["AssertionError", "ValueError"]),
    ("KeyboardInterrupt then SystemExit", ["KeyboardInterrupt", "SystemExit"]),
    ("DeprecationWarning: old", ["DeprecationWarning"]),
    ("Error: not found. Exception in thread. ERROR: bad", []),
])
def test_find_exception_names(text: str, expected: list[str]) -> None:
    assert find_exception_names(text) == expected


# ------------------------------------------------------------------------------------------
# index entries (the recallable layout's index calls)


@pytest.mark.parametrize(("steps", "seed", "max_tokens"), [(5, 1, 100), (12, 2, 40),
                                                           (40, 7, 100), (40, 7, 12)])
def test_an_index_entry_is_short_has_no_sections_and_keeps_to_its_cap(
        steps: int, seed: int, max_tokens: int) -> None:
    messages, facts = session(steps, seed)
    text = summarize_local_index(messages, max_tokens=max_tokens)
    assert text and "## " not in text
    assert COUNTER.count_text(text) <= max_tokens < input_tokens(messages)
    if max_tokens >= 100:
        assert text.startswith("Asked: ") and "Ran " in text
        assert any(name in text for name in facts["errors"]) or not facts["errors"]


def test_an_index_entry_continues_the_entry_of_the_chunk_so_far() -> None:
    messages, _ = session(12, 3)
    first = summarize_local_index(messages[:10], max_tokens=60)
    both = summarize_local_index(messages[10:], existing_summary=first, max_tokens=120)
    assert both.startswith(first[:30]) and COUNTER.count_text(both) <= 120


def test_an_index_entry_of_messages_without_text_says_so() -> None:
    text = summarize_local_index([Message(role="assistant", content="")] * 3, max_tokens=40)
    assert text == "3 messages without text."
