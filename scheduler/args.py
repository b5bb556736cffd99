"""Values from outside, checked before anything is opened: the CLI's argument types (a number or
duration a flag cannot use is a usage error, exit 2, that names the flag: argparse adds
``argument --limit:``), and the texts the CLI, the HTTP API and the client share (a duration, a
keep override)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from compactd.storage.errors import InvalidMessage
from compactd.storage.ids import MAX_INT32
from compactd.worker.compaction.policy import Clause, PolicyError, parse_keep_text

MAX_DURATION_S = 36_500 * 86_400  # a century
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr|d|day)?\s*$")
_UNITS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400,
          "day": 86400}


def whole(minimum: int, maximum: int = MAX_INT32) -> Callable[[str], int]:
    """A whole number from ``minimum`` to ``maximum`` (by default what an INTEGER column holds)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from {minimum} to {maximum}, got {text!r}")
        return value

    return parse


positive_int = whole(1)
count = whole(0)
port = whole(0, 65_535)


def seconds(text: str) -> float:
    """A finite number of seconds above 0: NaN would wait forever, and so would inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds above 0, got {text!r}")
    return value


def duration(text: str) -> str:
    """A duration such as 90s, 30m, 1h, 2d, checked now and kept as written."""
    try:
        parse_duration(text)
    except InvalidMessage as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None
    return text


def parse_duration(text: str) -> float:
    """Seconds in a duration such as 90s, 30m, 1h, 2d."""
    match = _DURATION.match(text.lower())
    if not match:
        raise InvalidMessage(f"not a duration: {text!r} (e.g. 90s, 30m, 1h, 2d)")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value > MAX_DURATION_S:
        # Further back than any session, and far enough to leave the calendar (year 1).
        raise InvalidMessage(f"a duration is at most {MAX_DURATION_S // 86_400:g}d, not {text!r}")
    return value


def parse_keep(text: str | Clause | None, path: str = "--keep") -> Clause | None:
    """A keep override from the CLI, the HTTP body or the client, refused as bad input when it
    does not parse (the worker reads the same text with the same parser)."""
    if text is None or isinstance(text, Clause):
        return text
    try:
        return parse_keep_text(text, path)
    except PolicyError as exc:
        raise InvalidMessage(str(exc), field="keep") from None
