"""Recall policy: references, footers, anchors, chunks and pointers (no I/O)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd.storage.kinds import NodeKind
from compactd.storage.messages import Message
from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import counter_for
from compactd.worker.compaction.boundary import unsafe_boundaries
from compactd.worker.compaction.recall import (
    FOOTER_MAX_TOKENS,
    META_RECALL,
    RecallArgumentError,
    Ref,
    Tally,
    checkpoint_footer,
    checkpoint_ref,
    chunk_history,
    extract_anchors,
    merge_anchors,
    merge_tallies,
    message_anchors,
    node_span,
    parse_ref,
    pointer_text,
    pruned_note,
    pruned_ref,
    span_of,
    tally,
)
from tests.support.pairs import cut_problems, node_rows
from tests.support.surfaces import ai, nodes, tool, user

COUNTERS = [counter_for(m) for m in (None, "gpt-4", "claude-sonnet-4")]
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------------
# references


@pytest.mark.parametrize(("text", "ref"), [
    ("c12-340", checkpoint_ref(12, 340)),
    ("c7-7", checkpoint_ref(7, 7)),
    (" r57 ", pruned_ref(57)),
    ("c0-999999999999", checkpoint_ref(0, 999_999_999_999)),
])
def test_a_reference_parses(text: str, ref: Ref) -> None:
    assert parse_ref(text) == ref


@pytest.mark.parametrize(("value", "says"), [
    ("", "is not a checkpoint"), ("c12", "is not a checkpoint"), ("12-340", "not a checkpoint"),
    ("C12-340", "not a checkpoint"), ("c340-12", "ends before it starts"),
    ("r-1", "not a checkpoint"), ("c1-2; drop table", "not a checkpoint"),
    (12, "must be a string"), (None, "must be a string"), ("x" * 500, "..."),
])
def test_a_bad_reference_is_refused_naming_the_argument(value: Any, says: str) -> None:
    with pytest.raises(RecallArgumentError) as caught:
        parse_ref(value)
    assert caught.value.argument == "checkpoint"
    assert str(caught.value).startswith("checkpoint: ") and says in str(caught.value)
    assert len(str(caught.value)) < 200


@given(st.integers(0, 10**15), st.integers(0, 10**15), st.booleans())
def test_a_reference_reads_back_as_itself(a: int, b: int, pruned: bool) -> None:
    ref = pruned_ref(a) if pruned else checkpoint_ref(min(a, b), max(a, b))
    assert parse_ref(str(ref)) == ref


def test_a_node_stands_for_its_stored_span_or_its_own_seq() -> None:
    plain, marked = nodes(user("a"), user("b", recall={"ref": "c3-9", "first": 3, "last": 9}),
                          start=20)
    assert node_span(plain) == (20, 20) and node_span(marked) == (3, 9)
    assert span_of([plain, marked]) == (3, 20)
    with pytest.raises(ValueError):
        span_of([])


# ------------------------------------------------------------------------------------------
# footers


def test_the_footer_and_the_note_read_exactly_so() -> None:
    # Part of the provider's cached prefix: a change here is a change for every session.
    assert checkpoint_footer(checkpoint_ref(12, 340)) == (
        '[originals: history_read(checkpoint="c12-340")]')
    assert pruned_note(pruned_ref(57)) == '[pruned; original: history_read(checkpoint="r57")]'


@pytest.mark.parametrize("counter", COUNTERS, ids=lambda c: c.name)
@pytest.mark.parametrize("ref", [checkpoint_ref(1, 2), checkpoint_ref(10**9 - 1000, 10**9 - 1),
                                 pruned_ref(10**9 - 1)], ids=str)
def test_footers_are_short_with_every_counter(counter: Any, ref: Ref) -> None:
    assert counter.count_text(checkpoint_footer(ref)) <= FOOTER_MAX_TOKENS
    assert counter.count_text(pruned_note(ref)) <= FOOTER_MAX_TOKENS


# ------------------------------------------------------------------------------------------
# anchors

TRACE = """Traceback (most recent call last):
  File "/srv/app/billing/tax.py", line 12, in compute
    rate = RATES[region]
KeyError: 'eu-west-9'"""


@pytest.mark.parametrize(("text", "expected"), [
    (TRACE, ("/srv/app/billing/tax.py", "KeyError: 'eu-west-9'")),
    ("error: could not compile `foo` (bin)", ("error: could not compile `foo` (bin)",)),
    ("  raise ValueError('bad input')", ("raise ValueError('bad input')",)),
    ("fatal: not a git repository", ("fatal: not a git repository",)),
    ("No errors found and nothing failed", ()),
    ("see https://example.com/a/b?x=1. Then", ("https://example.com/a/b?x=1",)),
    ("opened src/app/main.py and ./run.sh and ~/notes.md",
     ("src/app/main.py", "./run.sh", "~/notes.md")),
    ("read /etc/hosts then /var/log", ("/etc/hosts", "/var/log")),
    ("either and/or 1/2 of 2024/01/02", ()),
    ("request 123e4567-e89b-12d3-a456-426614174000 done",
     ("123e4567-e89b-12d3-a456-426614174000",)),
    ("fixed in 3f9a2c1 (was deadbeef, 1234567)", ("3f9a2c1",)),
    ("closes #88, see BILL-1234 and GH-7", ("#88", "BILL-1234", "GH-7")),
    ("p99 350 ms, 1.5 GB, 92% cpu, 4096 tokens, 12x", ("350 ms", "1.5 GB", "92%", "4096 tokens",
                                                       "12x")),
    ("version 3 of 10 files", ()),
])
def test_anchors_by_kind(text: str, expected: tuple[str, ...]) -> None:
    assert extract_anchors([text]) == expected


def test_anchors_come_in_order_of_first_appearance_once_each() -> None:
    texts = ["BILL-9 then src/a.py", "src/a.py again, then #3", "BILL-9", "ValueError: in src/a.py"]
    assert extract_anchors(texts) == ("BILL-9", "src/a.py", "#3", "ValueError: in src/a.py")


def test_anchors_are_bounded_keeping_errors_first_in_order() -> None:
    values = [f"{n} ms" for n in range(30)]
    text = " ".join(values[:10]) + "\nOSError: disk full\n" + " ".join(values[10:])
    kept = extract_anchors([text], max_count=5)
    assert kept == ("0 ms", "1 ms", "2 ms", "3 ms", "OSError: disk full")
    long = extract_anchors(["RuntimeError: " + "x" * 1000], max_chars=40)
    assert long == ("RuntimeError: " + "x" * 26,)
    minified = '{"log":"' + "x" * 5000 + '","err":"ValueError: bad thing","n":1}'
    (window,) = extract_anchors([minified], max_chars=60)
    assert "ValueError: bad thing" in window and len(window) <= 60 and window in minified


@pytest.mark.parametrize("unit", ["@", "+", "a@b+", "/@", "./", "A-", "1 ", "ab12", "Error ",
                                  "error:", "a/", " "])
@pytest.mark.timed
def test_anchor_patterns_stay_linear_on_long_repetitive_text(unit: str) -> None:
    # A tool result can be a megabyte of one character class; a pattern that backtracks over
    # it stalls the worker (the path pattern did on a run of "@" until its look-behind covered
    # its whole class).
    text = unit * (60_000 // len(unit))
    started = time.perf_counter()
    extract_anchors([text])
    assert time.perf_counter() - started < 2.0


def test_message_anchors_read_tool_calls_too() -> None:
    messages = [ai(None, ("c1", "read_file", {"path": "src/tax/rates.py"})),
                tool("c1", "ok")]
    assert message_anchors(messages) == ("src/tax/rates.py",)


def test_merged_anchors_keep_the_oldest_when_full() -> None:
    assert merge_anchors([("a.py", "#1"), ("#1", "b.py"), ("c.py",)], max_count=3) == (
        "a.py", "#1", "b.py")


FRAGMENTS = st.sampled_from([
    "word", " ", "\n", "src/x.py", "/srv/a b", "https://e.com/p).", "#12", "AB-34", "3f9a2c1",
    "KeyError: 'k'", "error: no", TRACE, "12 ms", "5%", "数据", "`", "Exception", "...",
    "123e4567-e89b-12d3-a456-426614174000"])


@SETTINGS
@given(st.lists(st.lists(FRAGMENTS, max_size=30).map("".join), max_size=6),
       st.integers(1, 30), st.integers(1, 200))
def test_every_anchor_is_an_exact_substring_once_within_bounds(
        texts: list[str], count: int, chars: int) -> None:
    anchors = extract_anchors(texts, max_count=count, max_chars=chars)
    assert len(anchors) <= count and len(set(anchors)) == len(anchors)
    for anchor in anchors:
        assert anchor and len(anchor) <= chars
        assert any(anchor in text for text in texts)
    assert extract_anchors(list(texts), max_count=count, max_chars=chars) == anchors


# ------------------------------------------------------------------------------------------
# chunks


def sized(*messages: Message, tokens: list[int]) -> list[SurfaceNode]:
    return nodes(*messages, tokens=tokens)


def test_chunks_close_before_the_unit_that_would_overflow() -> None:
    surface = sized(user("a"), ai("b"), user("c"), ai("d"), user("e"),
                    tokens=[40, 40, 40, 40, 40])
    chunks = chunk_history(surface, 0, 5, 100)
    assert [(c.start, c.end, c.tokens) for c in chunks] == [(0, 2, 80), (2, 5, 120)]
    assert [str(c.ref) for c in chunks] == ["c1-2", "c3-5"]


def test_a_tool_group_is_never_split_and_may_be_a_chunk_alone() -> None:
    surface = sized(user("a"), ai(None, ("c1", "bash"), ("c2", "bash")), tool("c1"), user("x"),
                    tool("c2"), ai("done"),
                    tokens=[50, 50, 200, 10, 200, 50])
    chunks = chunk_history(surface, 0, 6, 100)
    assert [(c.start, c.end, c.tokens) for c in chunks] == [(0, 1, 50), (1, 5, 460), (5, 6, 50)]


def test_a_chunk_is_named_by_the_originals_it_covers() -> None:
    earlier = Message(role="user", content="s", meta={
        "checkpoint": True, META_RECALL: {"ref": "c1-40", "first": 1, "last": 40}})
    pruned = tool("c1", "cut", recall={"ref": "r43", "first": 43, "last": 43})
    surface = nodes(earlier, ai(None, ("c1", "bash")), pruned, user("next"), start=41,
                    tokens=[50, 20, 20, 20])
    surface[2] = SurfaceNode(90, "pruned", pruned, 20)  # the prune of seq 43 took seq 90
    (chunk,) = chunk_history(surface, 0, 4, 1000)
    assert (chunk.first, chunk.last, str(chunk.ref)) == (1, 44, "c1-44")


def test_a_small_last_chunk_joins_the_one_before() -> None:
    surface = sized(user("a"), ai("b"), user("c"), tokens=[60, 30, 20])
    assert [(c.start, c.end) for c in chunk_history(surface, 0, 3, 100)] == [(0, 3)]
    big = sized(user("a"), ai("b"), user("c"), tokens=[100, 60, 40])
    assert [(c.start, c.end) for c in chunk_history(big, 0, 3, 100)] == [(0, 1), (1, 3)]


@pytest.mark.parametrize(("start", "end", "size", "says"), [
    (0, 3, 0, "chunk_tokens"), (2, 1, 10, "not a range"), (0, 9, 10, "not a range"),
    (2, 3, 10, "cuts a tool-call group"),
])
def test_a_bad_chunk_request_is_refused(start: int, end: int, size: int, says: str) -> None:
    surface = sized(ai(None, ("c1", "bash")), user("mid"), tool("c1"), tokens=[5, 5, 5])
    with pytest.raises(ValueError, match=says):
        chunk_history(surface, start, end, size)


@st.composite
def histories(draw: Any) -> list[SurfaceNode]:
    messages: list[Message] = []
    waiting: list[str] = []
    for n in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(["user", "ai", "call", "answer", "answer"]))
        if kind == "call":
            ids = [f"k{n}-{i}" for i in range(draw(st.integers(1, 3)))]
            messages.append(ai(None, *[(i, "bash") for i in ids]))
            waiting.extend(ids)
        elif kind == "answer" and waiting:
            messages.append(tool(waiting.pop(draw(st.integers(0, len(waiting) - 1)))))
        else:
            messages.append(user("u") if kind == "user" else ai("a"))
    messages.extend(tool(i) for i in waiting)
    sizes = draw(st.lists(st.integers(1, 400), min_size=len(messages),
                          max_size=len(messages)))
    return nodes(*messages, tokens=sizes)


@SETTINGS
@given(histories(), st.integers(1, 600))
def test_chunks_partition_the_range_at_safe_boundaries(surface: list[SurfaceNode],
                                                       size: int) -> None:
    chunks = chunk_history(surface, 0, len(surface), size)
    assert chunk_history(list(surface), 0, len(surface), size) == chunks
    bounds = [(c.start, c.end) for c in chunks]
    assert [a for a, _ in bounds] == ([0, *[e for _, e in bounds[:-1]]] if bounds else [])
    assert (bounds[-1][1] if bounds else 0) == len(surface)
    unsafe = unsafe_boundaries(surface)
    rows = node_rows(surface)
    for chunk in chunks:
        assert chunk.end > chunk.start and not unsafe[chunk.start]
        assert chunk.tokens == sum(n.tokens for n in surface[chunk.start:chunk.end])
        inside = {n.seq for n in surface[chunk.start:chunk.end]}
        assert cut_problems(rows, inside) == []
        # about chunk_tokens: within one and a half, unless one unit alone is larger
        units = sum(1 for b in range(chunk.start + 1, chunk.end) if not unsafe[b]) + 1
        assert chunk.tokens * 2 <= size * 3 or units == 1


# ------------------------------------------------------------------------------------------
# tallies and pointers


def test_a_tally_counts_roles_and_calls_and_adds_stored_tallies() -> None:
    stored = Tally(10, 900, (("user", 4), ("tool", 6)), (("bash", 6),))
    index = Message(role="user", content="x", meta={
        "checkpoint": True, META_RECALL: {"ref": "c1-9", "first": 1, "last": 9,
                                          "tally": stored.to_json()}})
    surface = nodes(index, ai(None, ("c1", "read_file"), ("c2", "bash")), tool("c1"),
                    tool("c2"), tokens=[120, 30, 40, 50], start=10)
    surface[0] = SurfaceNode(10, NodeKind.CHECKPOINT, index, 120)
    counts = tally(surface)
    assert counts == Tally(13, 240, (("user", 4), ("assistant", 1), ("tool", 8)),
                           (("bash", 7), ("read_file", 1)))
    assert Tally.from_json(counts.to_json()) == counts
    assert merge_tallies([stored, stored]).messages == 20


def test_a_pointer_says_what_it_covers_and_how_to_recall_it() -> None:
    counts = Tally(57, 8412, (("user", 20), ("assistant", 20), ("tool", 17)),
                   (("bash", 7), ("read_file", 5)))
    text = pointer_text(checkpoint_ref(12, 340), counts, ("KeyError: 'k'", "src/a.py"))
    assert text == (
        "Not summarized: 57 messages (user 20, assistant 20, tool 17), 8412 tokens; tool calls: "
        "bash 7, read_file 5.\n"
        "Anchors: `KeyError: 'k'` `src/a.py`\n"
        '[originals: history_read(checkpoint="c12-340")]')
    rolled = pointer_text(checkpoint_ref(1, 900), counts, (), rolled_up=6)
    assert rolled.startswith("Rolled up 6 earlier index checkpoints: 57 messages")
    assert "Anchors: (none)" in rolled


def test_a_pointer_with_full_anchors_stays_small() -> None:
    many = Tally(500, 90_000, (("user", 100), ("assistant", 200), ("tool", 200)),
                 tuple((f"tool_{i}", 20 - i) for i in range(20)))
    anchors = extract_anchors([f"src/pkg{i}/module_{i}.py ValueError{i}: x{i}\n"
                               for i in range(40)])
    text = pointer_text(checkpoint_ref(10**9, 10**9 + 5000), many, anchors)
    assert "and 12 more tools" in text
    assert counter_for(None).count_text(text) < 800
