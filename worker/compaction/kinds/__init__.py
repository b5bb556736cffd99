"""The closed set of trigger and keep kinds: each is one object (``base.Kind``) in its own
module, registered here by name.

Adding a kind: a module here with its ``Kind`` subclass, a line in :data:`KINDS`, and its tests.
A kind that measures something no registered counter counts also needs the counter: a
``storage.counters.Counter`` object (what one message adds to it) registered in
``storage.counters.COUNTERS``, with a kind of its own name; the storage keeps it counted by name
with no change of its own (sessions appended to before the release count it from then on:
``storage.counters`` says what that does and why there is no backfill).
"""

from __future__ import annotations

from compactd.storage.counters import COUNTERS, Counter
from compactd.worker.compaction.kinds.base import Kind
from compactd.worker.compaction.kinds.fraction import Fraction
from compactd.worker.compaction.kinds.messages import Messages
from compactd.worker.compaction.kinds.tokens import Tokens

KINDS: dict[str, Kind] = {kind.name: kind for kind in (Tokens(), Messages(), Fraction())}


def kind_of(name: str) -> Kind:
    """The kind named ``name``; ``KeyError`` for a name no kind has."""
    return KINDS[name]


def check_registry(kinds: dict[str, Kind], counters: dict[str, Counter] = COUNTERS) -> None:
    """Each kind is registered under its own name, and each counter has the kind of its own
    name measuring it as it is (what a keep falls back to and ``keep_at_pickup`` writes)."""
    for name, kind in kinds.items():
        if kind.name != name:
            raise RuntimeError(f"kind {kind.name!r} is registered as {name!r}")
        if counters.get(kind.counter.name) is not kind.counter:
            raise RuntimeError(f"kind {name!r} measures {kind.counter!r}, which is not "
                               "registered in storage.counters.COUNTERS")
    for name, counter in counters.items():
        if counter.name != name:
            raise RuntimeError(f"counter {counter.name!r} is registered as {name!r}")
        base = kinds.get(counter.name)
        if base is None or base.counter is not counter or base.needs_window:
            raise RuntimeError(f"counter {counter!r} has no kind of its own name measuring it")


check_registry(KINDS)

__all__ = ["KINDS", "Counter", "Kind", "check_registry", "kind_of"]
