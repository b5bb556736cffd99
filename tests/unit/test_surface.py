"""Where a replace puts its node (storage.surface.SurfaceRows): the one definition replay, the
SQLite commit and ``surface_after_commit`` share. Checked against a model that knows only the
order of the surface, and on logs that replay or must not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compactd.storage.kinds import NodeKind
from compactd.storage.surface import LoggedEvent, PlacementError, ReplayError, SurfaceRows, replay


def rows_of(*seqs: int) -> SurfaceRows:
    return SurfaceRows((i, seq, 1) for i, seq in enumerate(seqs, start=1))


def order(rows: SurfaceRows) -> list[int]:
    return [seq for _, seq, _ in rows.rows()]


def test_a_plain_replace_takes_the_first_position_of_its_run() -> None:
    rows = rows_of(1, 2, 3, 4)
    assert rows.replace(10, 5, (2, 3)) == 2
    assert rows.rows() == [(1, 1, 1), (2, 10, 5), (4, 4, 1)]


def test_before_swaps_the_node_and_the_one_preceding_the_run() -> None:
    rows = rows_of(1, 2, 3, 4, 5)
    rows.replace(10, 1, (2,))  # the "state" at position 2
    assert rows.replace(11, 1, (3, 4), before=10) == 2
    assert rows.rows() == [(1, 1, 1), (2, 11, 1), (3, 10, 1), (5, 5, 1)]
    # A seq replaced here stands for the node that replaced it.
    assert rows.replace(12, 1, (5,), before=10) == 3
    assert order(rows) == [1, 11, 12, 10]


def test_after_inserts_into_the_free_position_and_resolves_a_replaced_seq() -> None:
    rows = rows_of(1, 2, 3, 4)
    rows.replace(10, 1, (2, 3))
    assert rows.replace(11, 1, (), after=3) == 3  # 3 was replaced by 10
    assert order(rows) == [1, 10, 11, 4]
    with pytest.raises(PlacementError, match="no free position directly after seq 11") as exc:
        rows.replace(12, 1, (), after=11)
    assert exc.value.what == "after"


@pytest.mark.parametrize(("replaces", "before", "after", "what"), [
    ((), None, None, "order"),
    ((9,), None, None, "order"),
    ((3, 2), None, None, "order"),
    ((2, 4), None, None, "contiguous"),
    ((3,), 1, None, "before"),  # 2 lies between
    ((1,), 2, None, "before"),  # the run is before the node
    ((3,), 9, None, "before"),
    ((3,), 2, 2, "before"),
    ((3,), None, 2, "after"),
    ((), None, 1, "after"),  # position 2 is taken
    ((), None, 9, "after"),
])
def test_a_replace_that_does_not_fit_changes_nothing(replaces: tuple[int, ...],
                                                     before: int | None, after: int | None,
                                                     what: str) -> None:
    rows = rows_of(1, 2, 3, 4)
    kept = rows.rows()
    with pytest.raises(PlacementError) as exc:
        rows.replace(10, 1, replaces, before=before, after=after)
    assert exc.value.what == what
    assert rows.rows() == kept


def test_a_replace_keeping_nodes_puts_its_node_after_the_last_of_them() -> None:
    rows = rows_of(1, 2, 3, 4, 5, 6, 7)
    # 3 (a request) and 5 (a reminder) stay where they are; the node follows them.
    assert rows.replace(10, 1, (2, 4, 6), keeps=(3, 5)) == 6
    assert order(rows) == [1, 3, 5, 10, 7]
    # The next plain replace of the node and what follows it starts where the node is.
    assert rows.replace(11, 1, (10, 7)) == 6
    assert order(rows) == [1, 3, 5, 11]


@pytest.mark.parametrize(("replaces", "keeps", "what"), [
    ((2, 4), (5,), "order"),  # the kept node is not inside the run
    ((2, 4), (2,), "order"),
    ((2, 5), (3,), "contiguous"),  # 4 lies inside, neither replaced nor kept
    ((2, 4), (9,), "order"),
    ((2, 4), (3, 3), "contiguous"),
])
def test_a_replace_keeping_nodes_that_does_not_fit_changes_nothing(
        replaces: tuple[int, ...], keeps: tuple[int, ...], what: str) -> None:
    rows = rows_of(1, 2, 3, 4, 5)
    kept = rows.rows()
    with pytest.raises(PlacementError) as exc:
        rows.replace(10, 1, replaces, keeps=keeps)
    assert exc.value.what == what
    assert rows.rows() == kept


@given(st.lists(st.tuples(st.sampled_from(["plain", "before", "after"]),
                          st.integers(0, 30), st.integers(1, 4)), max_size=40))
def test_placements_keep_the_order_a_model_of_the_order_gives(ops: list[tuple[str, int, int]]
                                                               ) -> None:
    """A plain replace puts its node where its run began; ``before`` puts it where the node
    before the run was, that node after it; ``after`` right behind the node, when a position
    is free there; a refused one changes nothing."""
    model = list(range(1, 21))
    rows = rows_of(*model)
    seq = 100
    for kind, at, length in ops:
        seq += 1
        i = at % len(model)
        run = tuple(model[i:i + length])
        before = after = None
        if kind == "before":
            if i == 0:
                continue
            before = model[i - 1]
        elif kind == "after":
            after, run = model[i], ()
        kept = rows.rows()
        try:
            rows.replace(seq, 1, run, before=before, after=after)
        except PlacementError:
            assert kind == "after" and rows.rows() == kept
            continue
        if kind == "plain":
            model[i:i + len(run)] = [seq]
        elif kind == "before":
            model[i - 1:i + len(run)] = [seq, model[i - 1]]
        else:
            model.insert(i + 1, seq)
        assert order(rows) == model


def message(seq: int) -> LoggedEvent:
    return LoggedEvent(seq=seq, kind=NodeKind.MESSAGE, tokens=1)


def checkpoint(seq: int, replaces: tuple[int, ...], **placement: int) -> LoggedEvent:
    return LoggedEvent(seq=seq, kind=NodeKind.CHECKPOINT, tokens=2, replaces=replaces,
                       **placement)


def test_replay_follows_placements_and_refuses_one_that_does_not_fit() -> None:
    log = [message(1), message(2), message(3), message(4), message(5),
           checkpoint(7, (2, 3)), checkpoint(9, (4,), before=7), checkpoint(11, (), after=4),
           message(12)]
    assert replay(log) == [(1, 1), (9, 2), (11, 2), (7, 2), (5, 1), (12, 1)]
    with pytest.raises(ReplayError, match="no free position"):
        replay([*log, checkpoint(14, (), after=1)])
    with pytest.raises(ReplayError, match="does not directly precede"):
        replay([*log, checkpoint(14, (12,), before=7)])


def test_replay_follows_a_replace_that_keeps_nodes() -> None:
    log = [message(1), message(2), message(3), message(4), message(5),
           LoggedEvent(seq=7, kind=NodeKind.CHECKPOINT, tokens=2, replaces=(2, 4), keeps=(3,)),
           message(8)]
    assert replay(log) == [(1, 1), (3, 1), (7, 2), (5, 1), (8, 1)]
