"""The recallable layout's plan (pure): chunks at tool-pair-safe boundaries, index checkpoints
frozen across passes and never in a range, one state after them, the roll-up, the pass guard,
and a pass interrupted between its commits resumed by the next. Passes are applied here with
storage's own placement rules (SurfaceRows), commit by commit, as the worker commits them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from compactd.storage.kinds import LayoutRole, NodeKind
from compactd.storage.messages import from_payload
from compactd.storage.records import Replacement
from compactd.storage.surface import SurfaceNode, SurfaceRows
from compactd.storage.tokens import counter_for
from compactd.worker.compaction.boundary import unsafe_boundaries
from compactd.worker.compaction.planner import plan
from compactd.worker.compaction.policy import PolicyError, parse_policy
from compactd.worker.compaction.prompt import INDEX_MARK, build_index_prompt
from compactd.worker.compaction.recall import is_index, layout_role, node_span
from compactd.worker.compaction.recallable import (
    INSERT,
    PLAIN,
    SWAP,
    RecallablePass,
    commit_count,
    commit_replacements,
    index_checkpoint,
    state_checkpoint,
    validate_index,
)
from compactd.worker.compaction.render import checkpoint_tokens
from compactd.worker.compaction.validation import validate_summary
from tests.support.surfaces import NOW, ai, ckpt, nodes, sys, tool, user

STATE_TEXT = "\n".join(f"## {name}\n- carried" for name in (
    "Primary Request and Intent", "Key Technical Concepts", "Files and Code", "Errors and Fixes",
    "Pending Jobs", "Current Work", "Next Step", "Critical Context"))


def policy(**raw: object):  # type: ignore[no-untyped-def]
    base = {"layout": "recallable", "trigger": ["tokens", 500_000],
            "keep": {"type": "messages", "value": 4}, "chunk_tokens": 800,
            "index_summary_tokens": 30, "index_max_tokens": 100_000,
            "trim_tokens_to_summarize": None}
    return parse_policy({**base, **raw}).resolve(None)


def steps(count: int, start: int = 0) -> list:  # type: ignore[type-arg]
    out = []
    for i in range(start, start + count):
        out += [ai(f"step {i}: look at src/mod{i}.py", (f"c{i}", "bash", {"cmd": f"run {i}"})),
                tool(f"c{i}", f"ran {i}\nKeyError: 'k{i}' in src/mod{i}.py " + "log " * 30,
                     name="bash")]
    return out


def long_session(count: int = 60) -> list[SurfaceNode]:
    return nodes(sys(), user("fix the build"), *steps(count))


def apply(surface: Sequence[SurfaceNode], reps: Sequence[Replacement]) -> list[SurfaceNode]:
    """``surface`` after one commit of ``reps``, the seqs given as the store gives them."""
    last = max(n.seq for n in surface) + 1  # the run's compaction/start
    rows = SurfaceRows((n.position, n.seq, n.tokens) for n in surface)
    known = {n.seq: n for n in surface}
    for j, rep in enumerate(reps):
        seq = last + 2 * j + 2
        rows.replace(seq, rep.tokens, rep.seqs, before=rep.before, after=rep.after)
        known[seq] = SurfaceNode(seq=seq, kind=NodeKind.CHECKPOINT,
                                 message=from_payload(rep.payload), tokens=rep.tokens)
    return [replace(known[q], position=p) for p, q, _ in rows.rows()]


def check_layout(surface: Sequence[SurfaceNode]) -> None:
    """[...][index checkpoints][at most one state][stale][tail], index before the state."""
    roles = [layout_role(n) for n in surface]
    assert roles.count(LayoutRole.STATE) <= 1
    if LayoutRole.STATE in roles:
        at = roles.index(LayoutRole.STATE)
        assert LayoutRole.INDEX not in roles[at:]


def run_pass(surface: list[SurfaceNode], pol, *, commits: int | None = None,  # type: ignore[no-untyped-def]
             force: bool = True) -> tuple[list[SurfaceNode], RecallablePass]:
    result = plan(surface, policy=pol, now=NOW, force=force, keep_override=pol.keep)
    p = result.recall_pass
    assert p is not None, result.why_no_summary
    written = replaced = 0
    for i in range(commits if commits is not None else commit_count(p)):
        index = ([index_checkpoint(p.chunks[i], f"what happened in {p.chunks[i].ref}", pol)]
                 if p.chunks else [])
        state = state_checkpoint(p.state, STATE_TEXT, pol)
        reps = commit_replacements(p, i, index, None, state)
        before = {n.seq: n.tokens for n in surface}
        written += sum(r.tokens for r in reps)
        replaced += sum(before[q] for r in reps for q in r.seqs)
        surface = apply(surface, reps)
        check_layout(surface)
    if commits is None:
        assert written < replaced  # the pass guard
    return surface, p


def test_a_first_pass_chunks_the_stale_history_and_inserts_the_state_after_it() -> None:
    pol = policy()
    surface = long_session()
    after, p = run_pass(surface, pol)
    assert p.mode == INSERT and len(p.chunks) >= 3 and p.rollup is None
    roles = [layout_role(n) for n in after]
    assert roles[:2] == [None, None]  # the system prompt, the rescued user request
    assert roles[2:2 + len(p.chunks)] == [LayoutRole.INDEX] * len(p.chunks)
    assert roles[2 + len(p.chunks)] == LayoutRole.STATE
    assert p.state.after == p.chunks[-1].replace_seqs[-1] and p.state.replace_seqs == ()
    # Chunks cover the run in order, each at tool-pair-safe boundaries, each named by its span.
    covered = [q for c in p.chunks for q in c.replace_seqs]
    assert covered == sorted(covered) and covered[0] == 3
    for c in p.chunks:
        calls = {m.tool_calls[0].id for n in surface if n.seq in c.replace_seqs
                 for m in [n.message] if m.tool_calls}
        results = {n.message.tool_call_id for n in surface if n.seq in c.replace_seqs
                   and n.message.role == "tool"}
        assert calls == results
        assert str(c.ref) == f"c{c.replace_seqs[0]}-{c.replace_seqs[-1]}"
    assert len(p.chunks[-1].replace_seqs) >= 2
    state = next(n for n in after if layout_role(n) == LayoutRole.STATE)
    assert str(p.state.ref) == f"s3-{covered[-1]}" and node_span(state) == (3, covered[-1])
    # The index checkpoint's line of anchors is code's, from the chunk's originals.
    first = next(n for n in after if is_index(n))
    assert "KeyError: 'k0' in src/mod0.py" in first.message.text
    assert first.message.text.count("what happened in") == 1


def test_later_passes_keep_every_index_checkpoint_byte_identical() -> None:
    pol = policy()
    surface = long_session()
    surface, _ = run_pass(surface, pol)
    frozen = [(n.seq, n.message.content, n.tokens) for n in surface if is_index(n)]
    for more in range(3):
        surface = extend(surface, steps(12, start=100 + 20 * more))
        surface, p = run_pass(surface, pol)
        assert p.mode == SWAP and p.state.replace_seqs != ()
        index = [(n.seq, n.message.content, n.tokens) for n in surface if is_index(n)]
        assert index[:len(frozen)] == frozen and len(index) > len(frozen)
        # No pass replaces an index checkpoint (no roll-up under this cap).
        assert not {q for c in p.chunks for q in c.replace_seqs} & {s for s, _, _ in frozen}
        frozen = index
        assert [layout_role(n) for n in surface].count(LayoutRole.STATE) == 1


def extend(surface: list[SurfaceNode], messages: list) -> list[SurfaceNode]:  # type: ignore[type-arg]
    """``surface`` with ``messages`` appended: seqs and positions after the last ones."""
    seq, position = max(n.seq for n in surface), max(n.position for n in surface)
    added = nodes(*messages, start=seq + 1)
    return [*surface, *(replace(n, position=position + 1 + i) for i, n in enumerate(added))]


def test_the_state_reads_the_previous_state_then_newer_index_checkpoints_then_the_stale() -> None:
    pol = policy()
    surface, first = run_pass(long_session(), pol)
    surface = extend(surface, steps(16, start=200))
    # Interrupted after its first commit: one new index checkpoint sits before the old state.
    interrupted, _ = run_pass(surface, pol, commits=1)
    lagging = [n for n in interrupted if is_index(n)][-1]
    assert node_span(lagging)[0] > first.state.span[1]
    resumed, q = run_pass(interrupted, pol)
    assert q.mode == SWAP
    read = [piece.seq for call in q.state.calls for piece in call.pieces]
    read += list(q.state.calls[0].summary_seqs)
    assert lagging.seq in read
    # The old state is the existing summary; the lagging index checkpoint is not replaced.
    assert q.state.existing_summary.startswith(STATE_TEXT[:20])
    assert lagging.seq not in q.replace_seqs
    assert [n.seq for n in resumed if n.seq == lagging.seq]
    assert q.state.span[0] == 3


def test_a_merge_checkpoint_is_read_as_the_previous_state() -> None:
    surface = nodes(sys(), user("fix it"), ckpt("## Current Work\n- merged earlier"),
                    *steps(10), start=1)
    _, p = run_pass(surface, policy())
    assert p.mode == SWAP and p.state.replace_seqs == (3,)
    assert all(c.before == 3 for c in p.chunks)
    assert "merged earlier" in p.state.existing_summary


def test_one_stale_node_is_a_plain_state_checkpoint() -> None:
    pol = policy(keep={"type": "messages", "value": 2})
    surface = nodes(sys(), user("go"), ai("thinking " * 200), user("and now"), ai("ok"))
    after, p = run_pass(surface, pol)
    # The old request is not the latest: with the thinking it is the stale history.
    assert p.mode == PLAIN and p.chunks == () and p.state.replace_seqs == (2, 3)
    assert [layout_role(n) for n in after] == [None, LayoutRole.STATE, None, None]


def test_index_checkpoints_roll_up_when_they_exceed_the_cap() -> None:
    pol = policy(index_max_tokens=1500)
    surface, _ = run_pass(long_session(), pol)
    rolled = None
    for more in range(6):
        surface = extend(surface, steps(12, start=300 + 20 * more))
        index_before = [n for n in surface if is_index(n)]
        surface, p = run_pass(surface, pol)
        if p.rollup is not None:
            rolled = p.rollup
            break
    assert rolled is not None
    # The oldest index checkpoints, one contiguous run from the first, became one pointer.
    assert rolled.replace_seqs == tuple(n.seq for n in index_before[:len(rolled.replace_seqs)])
    pointer = next(n for n in surface if is_index(n))
    meta = pointer.message.meta["recall"]
    assert meta["rolled_up"] == rolled.rolled_up >= 2 and meta["pointer"] is True
    assert f"Rolled up {rolled.rolled_up} earlier index checkpoints" in pointer.message.text
    assert node_span(pointer) == (node_span(index_before[0])[0],
                                  node_span(index_before[len(rolled.replace_seqs) - 1])[1])
    assert sum(n.tokens for n in surface if is_index(n)) <= pol.index_max_tokens


def test_the_pass_guard_refuses_a_pass_that_cannot_shrink() -> None:
    # A state allowed no room: the stale history is small beside the index checkpoints.
    pol = policy(chunk_tokens=40, index_summary_tokens=10, keep={"type": "messages", "value": 2})
    surface = nodes(sys(), user("go"), *[ai(f"a{i}") for i in range(8)], user("next"), ai("ok"))
    result = plan(surface, policy=pol, now=NOW, force=True, keep_override=pol.keep)
    assert result.recall_pass is None and result.summarize is None
    assert result.why_no_summary is not None and "would not shrink" in result.why_no_summary


def test_the_state_and_index_validators_hold_the_bounds() -> None:
    pol = policy()
    _, p = run_pass(long_session(), pol)
    step = p.chunks[0]
    counter = counter_for(None)
    assert validate_index("Ran the build; KeyError in mod0.", step, pol, None, counter,
                          final=True) is None
    too_long = "word " * 100
    assert "over index_summary_tokens" in (validate_index(too_long, step, pol, None, counter,
                                                          final=True) or "")
    assert validate_index("  ", step, pol, None, counter, final=True) is not None
    # The state is held to the room the index bounds leave it.
    reason = validate_summary(STATE_TEXT, replaced_tokens=10, policy=pol, run_model=None,
                              recall=p.state.recall)
    assert reason is not None and "not fewer" in reason
    assert checkpoint_tokens(step.pointer, None) <= step.bound_tokens


def test_an_index_call_asks_for_a_short_entry_not_the_eight_sections() -> None:
    pol = policy()
    _, p = run_pass(long_session(), pol)
    chat = build_index_prompt(p.chunks[0].calls[0], None, pol)
    assert chat[-1]["content"].startswith(INDEX_MARK)
    assert "## Current Work" not in chat[-1]["content"]
    assert "at most 30 tokens" in chat[-1]["content"]


def test_the_plan_json_shows_the_pass() -> None:
    pol = policy()
    result = plan(long_session(), policy=pol, now=NOW, force=True, keep_override=pol.keep)
    body = result.to_json()
    assert body["layout"] == "recallable"
    summary = body["summarize"]
    assert summary["mode"] == INSERT and summary["state"]["checkpoint"].startswith("s3-")
    assert summary["chunks"][0]["checkpoint"].startswith("c3-")
    assert summary["replace_seqs"] == sorted(
        q for c in summary["chunks"] for q in c["replace_seqs"])
    assert len(summary["calls"]) == sum(len(c["calls"]) for c in summary["chunks"]) + len(
        summary["state"]["calls"])


@pytest.mark.parametrize("layout", ["merge", "recallable"])
def test_the_layout_key_decides_which_plan_is_made(layout: str) -> None:
    pol = policy(layout=layout)
    result = plan(long_session(), policy=pol, now=NOW, force=True, keep_override=pol.keep)
    assert (result.recall_pass is not None) == (layout == "recallable")
    assert (result.summarize is not None) == (layout == "merge")


def test_unsafe_boundaries_hold_in_every_chunk() -> None:
    pol = policy(chunk_tokens=600)
    surface = long_session(40)
    _, p = run_pass(surface, pol)
    unsafe = unsafe_boundaries(surface)
    index = {n.seq: i for i, n in enumerate(surface)}
    for c in p.chunks:
        assert not unsafe[index[c.replace_seqs[0]]]
        assert not unsafe[index[c.replace_seqs[-1]] + 1]


# ------------------------------------------------------------------------------------------
# the configuration keys: refused at load naming the key path, and each with its effect


@pytest.mark.parametrize(("raw", "path", "words"), [
    ({"layout": "stack"}, "summarization.layout", "must be one of merge, recallable"),
    ({"chunk_tokens": 0}, "summarization.chunk_tokens", "must be positive"),
    ({"chunk_tokens": 80}, "summarization.chunk_tokens", "must be below chunk_tokens (80)"),
    ({"index_summary_tokens": 2500}, "summarization.index_summary_tokens",
     "must be below chunk_tokens (2000)"),
    ({"index_summary_tokens": 1.5}, "summarization.index_summary_tokens", "an integer"),
    ({"index_max_tokens": 300}, "summarization.index_max_tokens", "at least 4 times"),
    ({"layout": "recallable", "trigger": [["tokens", 3000]]}, "summarization.trigger",
     "index_max_tokens (4000) must be below trigger group 0 (tokens>=3000)"),
    ({"layout": "recallable", "trigger": [["tokens", 9000]], "index_max_tokens": 9000},
     "summarization.index_max_tokens", "the index checkpoints alone would fire it again"),
])
def test_a_bad_layout_key_is_a_load_error_naming_its_path(raw: dict[str, object], path: str,
                                                          words: str) -> None:
    with pytest.raises(PolicyError) as exc:
        parse_policy(raw)
    assert exc.value.path == path and words in str(exc.value), str(exc.value)


def test_chunk_tokens_sets_how_much_history_an_index_checkpoint_stands_for() -> None:
    counts = []
    for size in (800, 1600):
        pol = policy(chunk_tokens=size)
        result = plan(long_session(), policy=pol, now=NOW, force=True, keep_override=pol.keep)
        assert result.recall_pass is not None
        counts.append(len(result.recall_pass.chunks))
        assert all(c.replaced_tokens <= size for c in result.recall_pass.chunks[:-1])
    assert counts[0] > counts[1] >= 2


def test_index_summary_tokens_caps_the_index_call_and_its_entry() -> None:
    counter = counter_for(None)
    entry = "The build ran and failed with KeyError in src/mod0.py; " * 3
    for cap, accepted in ((20, False), (80, True)):
        pol = policy(index_summary_tokens=cap)
        _, p = run_pass(long_session(), pol)
        chat = build_index_prompt(p.chunks[0].calls[0], None, pol)
        assert f"at most {cap} tokens" in chat[-1]["content"]
        assert (validate_index(entry, p.chunks[0], pol, None, counter, final=False)
                is None) == accepted
        bounds = {c.bound_tokens - c.pointer_tokens for c in p.chunks}
        assert max(bounds) <= cap + 8


def test_index_max_tokens_decides_when_the_oldest_roll_up_and_what_a_pass_adds() -> None:
    rolled: dict[int, list[bool]] = {}
    for cap in (1500, 100_000):
        pol = policy(index_max_tokens=cap)
        surface, _ = run_pass(long_session(), pol)
        rolled[cap] = []
        for more in range(6):
            surface = extend(surface, steps(24, start=500 + 30 * more))
            surface, p = run_pass(surface, pol)
            rolled[cap].append(p.rollup is not None)
            # No pass adds more than half the cap (a long history makes fewer, larger chunks).
            assert sum(c.bound_tokens for c in p.chunks) * 2 <= cap or len(p.chunks) == 1
    assert any(rolled[1500]) and not any(rolled[100_000])


@pytest.mark.parametrize("prior", [False, True])
def test_index_checkpoints_done_together_commit_together_to_the_same_surface(prior: bool
                                                                             ) -> None:
    """The worker commits every index checkpoint whose call is done at once: one commit of
    several gives the surface one commit each gives (swap and insert alike)."""
    pol = policy()
    surface = long_session()
    if prior:
        surface, _ = run_pass(surface, pol)
        surface = extend(surface, steps(30, start=700))
    one_each, p = run_pass(surface, pol)
    assert p.mode == (SWAP if prior else INSERT) and len(p.chunks) >= 2
    indexes = [index_checkpoint(c, f"what happened in {c.ref}", pol) for c in p.chunks]
    together = apply(surface, commit_replacements(
        p, 0, indexes, None, state_checkpoint(p.state, STATE_TEXT, pol)))
    check_layout(together)

    def shape(nodes: list[SurfaceNode]) -> list[tuple[object, ...]]:
        return [(n.message.content, n.tokens, n.position) for n in nodes]

    assert shape(together) == shape(one_each)
