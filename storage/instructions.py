"""Instructions for one manual compaction: the user's (or the agent's) focus for its summary.

Checked the same way by every interface that takes them (the client's ``compact`` and
``compact_context``, ``compactd compact --instructions``, the HTTP routes, the LangChain
middleware's tool) and by storage before a request is recorded, so text over the bound is
refused before anything is queued or stored. A run coalesced from several requests keeps each
distinct text once, in the order they came, up to :data:`MAX_INSTRUCTIONS`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from compactd.storage.errors import InvalidMessage

# A focus, not a document: a paragraph or two. Longer text is refused, never cut.
MAX_INSTRUCTION_CHARS = 2000
# Distinct texts one run carries; a request that would add one more is refused.
MAX_INSTRUCTIONS = 8
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_instructions(text: object, argument: str = "instructions") -> str:
    """``text`` as a run's instructions, or :class:`InvalidMessage` naming ``argument``."""
    if not isinstance(text, str):
        raise InvalidMessage(f"must be a string, got {type(text).__name__}", field=argument)
    if not text.strip():
        raise InvalidMessage("is empty", field=argument)
    if "\x00" in text:
        raise InvalidMessage("contains a NUL character", field=argument)
    if _LONE_SURROGATE.search(text):
        raise InvalidMessage("is not valid UTF-8 text (a lone surrogate)", field=argument)
    if len(text) > MAX_INSTRUCTION_CHARS:
        raise InvalidMessage(f"is {len(text)} characters long; at most "
                             f"{MAX_INSTRUCTION_CHARS} are taken", field=argument)
    return text


def merge_instructions(held: Iterable[str], added: Iterable[str]) -> tuple[str, ...]:
    """``held`` followed by the texts of ``added`` it lacks (a coalesced request's); over
    :data:`MAX_INSTRUCTIONS` distinct texts is refused."""
    merged = list(dict.fromkeys(held))
    for text in added:
        if text not in merged:
            merged.append(text)
    if len(merged) > MAX_INSTRUCTIONS:
        raise InvalidMessage(f"the queued compaction of this session already carries "
                             f"{MAX_INSTRUCTIONS} distinct instructions; wait for it to start",
                             field="instructions")
    return tuple(merged)


def first_instructions(*groups: Iterable[str]) -> tuple[str, ...]:
    """The distinct texts of ``groups``, in order, the first :data:`MAX_INSTRUCTIONS` of them:
    what a run takes from several holders at once, where refusing is no longer possible (the
    request that brought them was answered). No holder is over the bound, but a mark taken
    over after its TTL can add to what an earlier delivery recorded: the first are kept, as a
    coalesced request over the bound is refused."""
    return tuple(dict.fromkeys(text for group in groups for text in group))[:MAX_INSTRUCTIONS]


def carry_instructions(carried: Iterable[str], added: Iterable[str]
                       ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A request that takes a manual mark over (a stale one, whose task was lost, or one a busy
    run left): its own texts after those of ``carried`` that fit, and the carried texts left
    out. No task will start for the texts on that mark, so "wait for it to start" would refuse
    every request that brings a new text; the oldest carried ones give way instead."""
    held = list(dict.fromkeys(carried))
    dropped: list[str] = []
    while True:
        try:
            return merge_instructions(held, added), tuple(dropped)
        except InvalidMessage:
            if not held:
                raise
            dropped.append(held.pop(0))
