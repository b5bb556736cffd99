"""Placed replaces on PostgreSQL and SQLite: a node put directly before the node preceding its
run (a swap), or inserted into the free position after a node, as the ``recallable`` layout
commits them. After every commit the log replays to the stored surface (``verify``), the surface
computed without a read equals the one read back, and a placement that does not fit is refused
with nothing written."""

from __future__ import annotations

import pytest

from compactd.storage.errors import SurfaceChanged
from compactd.storage.kinds import JournalKind, NodeKind, RunStatus
from compactd.storage.messages import Message, from_payload, parse_openai
from compactd.storage.records import Claim, Replacement, RunEnd, SessionInfo
from compactd.storage.store import Store
from compactd.storage.surface import NewNode, Surface, surface_after_commit


def user(text: str) -> Message:
    return parse_openai({"role": "user", "content": text})


def node(name: str, *, first: int | None = None, last: int | None = None,
         seqs: tuple[int, ...] = (), before: int | None = None,
         after: int | None = None, keeps: tuple[int, ...] = ()) -> Replacement:
    """A checkpoint named ``name``; ``first``/``last`` its stated recall span."""
    meta: dict[str, object] = {"checkpoint": True}
    if first is not None and last is not None:
        meta["recall"] = {"ref": name, "first": first, "last": last}
    message = user(name).model_copy(update={"meta": meta})
    return Replacement(seqs=seqs, kind=NodeKind.CHECKPOINT, payload=message.to_payload(),
                       tokens=3, journal_kind=JournalKind.SUMMARY, journal={"text": name},
                       before=before, after=after, keeps=keeps)


async def open_session(store: Store, count: int = 8) -> Claim:
    await store.create_session("s1", run_model="gpt-4o")
    await store.append("s1", [user(f"message {i}") for i in range(1, count + 1)])
    claimed = await store.claim("s1", owner="w1", trigger="manual", lease_s=30)
    assert isinstance(claimed, Claim)
    return claimed


async def commit(store: Store, c: Claim, reps: list[Replacement], *,
                 end: bool = False) -> SessionInfo:
    """Commit ``reps`` and check what every commit must leave: a log that replays to the stored
    surface, totals that match it, and the surface :func:`surface_after_commit` predicts."""
    before = await store.read_surface("s1")
    info = await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=reps,
                              end=RunEnd(outcome=RunStatus.COMMITTED) if end else None)
    read = await store.read_surface("s1")
    verified = await store.verify("s1")
    assert verified.ok, verified.problems
    assert info.surface_tokens == read.tokens and info.surface_messages == len(read.nodes)
    if not end:
        predicted = surface_after_commit(
            before, [NewNode(r.seqs, r.kind, from_payload(r.payload), r.tokens, r.before,
                             r.after, r.keeps) for r in reps],
            version=info.surface_version, last_seq=info.last_seq)
        assert predicted is not None
        assert [(n.position, n.seq, n.tokens) for n in predicted.nodes] == [
            (n.position, n.seq, n.tokens) for n in read.nodes]
    return info


def texts(surface: Surface) -> list[str]:
    return [n.message.text for n in surface.nodes]


async def test_index_checkpoints_go_in_front_of_the_state_one_commit_at_a_time(
        store: Store) -> None:
    """A pass with a state: each index checkpoint swaps places with the state, and the last
    commit also replaces the state; the surface stays [index...][state][stale][tail]."""
    c = await open_session(store)  # seqs 1..8, the claim's start is 9
    await commit(store, c, [node("state", seqs=(2, 3))])  # journal 10, node 11
    assert texts(await store.read_surface("s1")) == [
        "message 1", "state", "message 4", "message 5", "message 6", "message 7", "message 8"]
    await commit(store, c, [node("J1", seqs=(4,), before=11)])  # node 13
    assert texts(await store.read_surface("s1")) == [
        "message 1", "J1", "state", "message 5", "message 6", "message 7", "message 8"]
    # The last commit: the last index checkpoint in front of the state, then the new state.
    await commit(store, c, [node("J2", seqs=(5, 6), before=11), node("state 2", seqs=(11,))],
                 end=True)
    surface = await store.read_surface("s1")
    assert texts(surface) == ["message 1", "J1", "J2", "state 2", "message 7", "message 8"]
    events = await store.read_events("s1", kinds=[NodeKind.CHECKPOINT])
    assert [e.payload.get("before") for e in events] == [None, 11, 11, None]
    # Positions: the state moved to each run's first position, each index took the state's.
    assert [n.position for n in surface.nodes] == [1, 2, 4, 5, 7, 8]


async def test_a_first_state_goes_after_the_last_index_checkpoint(store: Store) -> None:
    """No state yet: the index checkpoints replace plainly, and the new state is inserted into
    the position the last one's run left free, naming a seq that run replaced (the commit
    cannot know the new node's seq)."""
    c = await open_session(store)
    await commit(store, c, [node("J1", seqs=(2, 3))])
    await commit(store, c, [node("J2", seqs=(4, 5)),
                            node("state", first=2, last=5, after=5)], end=True)
    surface = await store.read_surface("s1")
    assert texts(surface) == ["message 1", "J1", "J2", "state", "message 6", "message 7",
                              "message 8"]
    assert [n.position for n in surface.nodes] == [1, 2, 4, 5, 6, 7, 8]
    state = surface.nodes[3]
    events = await store.read_events("s1", kinds=[NodeKind.CHECKPOINT])
    assert events[-1].payload["after"] == 5 and events[-1].payload["replaces"] == []
    # The state replaced nothing, yet its recall name reads every original in its span.
    page = await store.history_read("s1", "state")
    assert page.seqs == (2, 3, 4, 5)
    assert state.seq == events[-1].seq


async def test_an_insert_after_a_node_on_the_surface(store: Store) -> None:
    c = await open_session(store)
    info = await commit(store, c, [node("J1", seqs=(2, 3, 4))])
    # J1's run left positions 3 and 4 free: the state takes 3, a note after the state 4.
    info = await commit(store, c, [node("state", after=info.last_seq)])
    info = await commit(store, c, [node("note", after=info.last_seq)])
    assert texts(await store.read_surface("s1"))[:5] == [
        "message 1", "J1", "state", "note", "message 5"]
    # Position 5 holds message 5.
    await _unchanged(store, c, [node("more", after=info.last_seq)],
                     f"no free position directly after seq {info.last_seq}")


async def test_a_recall_span_comes_from_meta_recall_when_it_states_one(store: Store) -> None:
    c = await open_session(store)
    await commit(store, c, [node("c2-3", first=2, last=3, seqs=(2, 3))])
    await commit(store, c, [node("c4-5", seqs=(4, 5))])  # no stated span: the union
    # A state replacing only the first checkpoint names the span it says it absorbed.
    info = await commit(store, c, [node("s2-5", first=2, last=5, seqs=(11,))])
    assert (await store.history_read("s1", "s2-5")).seqs == (2, 3, 4, 5)
    assert (await store.history_read("s1", "c4-5")).seqs == (4, 5)
    hits = await store.history_search("s1", "message 4", checkpoint="s2-5")
    exact = [(h.seq, h.checkpoint) for h in hits.hits if h.exact]
    assert exact == [(4, "c4-5")]
    assert info.surface_messages == 6


async def _unchanged(store: Store, c: Claim, reps: list[Replacement], problem: str) -> None:
    surface, info = await store.read_surface("s1"), await store.get_session("s1")
    events = await store.read_events("s1")
    with pytest.raises(SurfaceChanged, match=problem):
        await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=reps,
                           end=RunEnd(outcome=RunStatus.COMMITTED))
    assert await store.read_surface("s1") == surface
    assert await store.get_session("s1") == info
    assert await store.read_events("s1") == events
    run = await store.get_run(c.run_id)
    assert run is not None and run.status == RunStatus.RUNNING


async def test_a_placement_that_does_not_fit_is_refused_with_nothing_written(
        store: Store) -> None:
    c = await open_session(store)
    await commit(store, c, [node("state", seqs=(2, 3))])  # node 11 at position 2
    # Another node lies between the state and the run.
    await _unchanged(store, c, [node("J", seqs=(5,), before=11)],
                     r"seq 11 no longer directly precedes seqs \[5\]")
    # The run is before the node, not after it.
    await _unchanged(store, c, [node("J", seqs=(1,), before=11)],
                     r"seq 11 no longer directly precedes seqs \[1\]")
    # Not on the surface at all.
    await _unchanged(store, c, [node("J", seqs=(4,), before=99)],
                     r"seq 99 no longer directly precedes")
    # Position 2 holds the state: there is no free position after message 1.
    await _unchanged(store, c, [node("late", after=1)],
                     "no free position directly after seq 1")
    await _unchanged(store, c, [node("late", after=99)],
                     "no free position directly after seq 99")
    # A good replacement before a bad one is not kept either (one transaction, one call).
    await _unchanged(store, c, [node("J", seqs=(4,), before=11), node("late", after=1)],
                     "no free position directly after seq 1")
    # A seq replaced by an earlier replacement of another commit is not resolved.
    await _unchanged(store, c, [node("late", after=2)], "no free position directly after seq 2")
    for bad, problem in (
            ([node("x", seqs=(4,), before=11, after=11)], "before a node or after one"),
            ([node("x", seqs=(4,), after=11)], "placed after a node replaces nothing"),
            ([node("x")], "at least one seq")):
        with pytest.raises(ValueError, match=problem):
            await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=bad)
    assert (await store.verify("s1")).ok


async def test_a_checkpoint_keeping_nodes_inside_its_run_follows_them(store: Store) -> None:
    """A summary of a range split by the latest request (seq 4): one commit replaces both
    sides, the request stays verbatim, the checkpoint follows it; the log replays."""
    c = await open_session(store)
    info = await commit(store, c, [node("summary", seqs=(2, 3, 5, 6), keeps=(4,)),
                                   node("pruned", seqs=(7,))])
    assert texts(await store.read_surface("s1")) == [
        "message 1", "message 4", "summary", "pruned", "message 8"]
    assert info.surface_messages == 5
    # The next commit replaces the checkpoint and what follows it, keeping the request.
    await commit(store, c, [node("summary 2", seqs=(11, 13))], end=True)
    assert texts(await store.read_surface("s1")) == [
        "message 1", "message 4", "summary 2", "message 8"]


async def test_a_checkpoint_keeping_nodes_that_do_not_fit_is_refused_with_nothing_written(
        store: Store) -> None:
    c = await open_session(store)
    # Message 5 lies inside the run, neither replaced nor kept.
    await _unchanged(store, c, [node("s", seqs=(2, 3, 6), keeps=(4,))],
                     "no longer one contiguous run")
    # The kept node is not inside the run.
    await _unchanged(store, c, [node("s", seqs=(2, 3), keeps=(4,))],
                     "no longer on the surface in that order")
    for bad, problem in (
            ([node("s", seqs=(2, 4), keeps=(3,), after=1)], "placed after a node"),
            ([node("s", seqs=(2, 3), keeps=(3,))], "keeps a seq it replaces")):
        with pytest.raises(ValueError, match=problem):
            await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=bad)
    assert (await store.verify("s1")).ok


async def test_a_checkpoint_keeping_a_node_an_earlier_replacement_replaced_is_refused(
        store: Store) -> None:
    """Replacements apply in order: a node an earlier one replaced (a pruned result) is gone
    before a later one could keep it. PostgreSQL's one call checks every unplaced replacement
    on the surface as it was, so it wrote that commit, leaving a log that does not replay;
    SQLite refused it as a changed surface. Both refuse it before anything is read."""
    c = await open_session(store)
    pruned = node("pruned", seqs=(4,))
    with pytest.raises(ValueError, match="keeps a seq an earlier replacement replaces"):
        await store.commit("s1", run_id=c.run_id, fence=c.fence,
                           replacements=[pruned, node("summary", seqs=(2, 3, 5, 6), keeps=(4,))])
    assert texts(await store.read_surface("s1")) == [f"message {i}" for i in range(1, 9)]
    assert (await store.verify("s1")).ok
    # In the other order the checkpoint keeps the node, then the prune replaces it.
    await commit(store, c, [node("summary", seqs=(2, 3, 5, 6), keeps=(4,)), pruned])
    assert texts(await store.read_surface("s1")) == [
        "message 1", "pruned", "summary", "message 7", "message 8"]
