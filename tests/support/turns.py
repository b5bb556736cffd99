"""A reader of the summarizer's transcript: the grammar ``worker.compaction.prompt`` renders and
the summarizer is told about, for tests that check no content can forge a turn."""

from __future__ import annotations

import html
import re
from typing import Any

HEADER = re.compile(r'^<turn seq="(?P<seq>\d+)" role="(?P<role>[^"]*)"'
                    r'(?: name="(?P<name>[^"]*)")?(?: part="(?P<part>\d+/\d+)")?>$')
CLOSE = "</turn>"


def parse_turns(text: str) -> list[tuple[dict[str, Any], str]]:
    """The turns of a rendered transcript: each header line opens one, ``</turn>`` closes it,
    and the text between them is its content, unescaped. Raises AssertionError where the
    markup does not nest."""
    turns: list[tuple[dict[str, Any], str]] = []
    open_turn: dict[str, Any] | None = None
    body: list[str] = []
    for line in text.split("\n"):
        header = HEADER.match(line)
        if header:
            assert open_turn is None, f"a header inside a turn: {line!r}"
            open_turn = {k: html.unescape(v) for k, v in header.groupdict().items() if v}
            body = []
        elif line == CLOSE:
            assert open_turn is not None, "a close outside a turn"
            turns.append((open_turn, html.unescape("\n".join(body))))
            open_turn = None
        elif open_turn is not None:
            body.append(line)
    assert open_turn is None, "a turn left open"
    return turns
