"""Argument types of the CLI: a number or duration a flag cannot use is a usage error (exit 2)
that names the flag (argparse adds ``argument --limit:``), before anything is opened."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from storage.errors import InvalidMessage
from storage.ids import MAX_INT32


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
    from scheduler.bulk import parse_duration

    try:
        parse_duration(text)
    except InvalidMessage as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None
    return text
