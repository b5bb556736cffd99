"""What a session id or a tenant name may be: one rule for every door (HTTP, client, CLI, store);
and the numbers callers pass that end in an INTEGER column or bound a wait.

Printable text of at most 255 characters that is not only blanks. Control characters (NUL
included) are refused because PostgreSQL cannot store a NUL and a terminal or log line should not
carry the others; a lone surrogate (what Python makes of bytes that are not UTF-8, as in a
command-line argument) and U+FFFD (what an HTTP server makes of them, so ``x%FFy`` and ``x%FEy``
would both become ``x\ufffdy``) are refused so two different inputs never name one session.
"""

from __future__ import annotations

import math
import re
from typing import Any

from compactd.storage.errors import InvalidMessage

MAX_ID_LENGTH = 255  # the columns' length
MAX_INT32 = 2_147_483_647  # the largest value an INTEGER column holds (context_window, usage)
REPLACEMENT = "\ufffd"
# The same rule for OpenAPI documents and schema-driven clients (control characters, U+FFFD).
ID_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\uFFFD]+$"
# What is refused, in one search on the path of every request: the control characters
# (exactly Unicode's category Cc), lone surrogates and U+FFFD.
_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufffd]")


def id_problem(value: Any, what: str = "a session id") -> str | None:
    """Why ``value`` cannot be ``what``, or None when it can."""
    if not isinstance(value, str):
        return f"{what} must be a string, not {type(value).__name__}"
    if not value.strip():
        return f"{what} must not be empty or blank"
    if len(value) > MAX_ID_LENGTH:
        return f"{what} is at most {MAX_ID_LENGTH} characters, not {len(value)}"
    bad = _REFUSED.search(value)
    if bad is None:
        return None
    char, position = bad.group(), bad.start()
    if "\ud800" <= char <= "\udfff":
        return f"{what} must be valid UTF-8 (an undecodable byte at character {position})"
    if char == REPLACEMENT:
        return (f"{what} must not contain U+FFFD, which stands for bytes that are not valid "
                f"UTF-8 (character {position})")
    return (f"{what} must not contain control characters (U+{ord(char):04X} at character "
            f"{position})")


def check_id(value: Any, *, field: str = "session", what: str = "a session id") -> str:
    """``value`` when it is a valid id, else :class:`InvalidMessage` naming ``field``."""
    problem = id_problem(value, what)
    if problem is not None:
        raise InvalidMessage(problem, field=field)
    return str(value)


# An append's idempotency key: printable ASCII without blanks, as the ``Idempotency-Key``
# header of HTTP APIs that take one carries it (a uuid4 is 32 or 36 of these).
_KEY = re.compile(r"[\x21-\x7e]+")


def check_idempotency_key(value: Any, *, field: str = "idempotency_key") -> str:
    """``value`` when it can be an append's idempotency key (1 to 255 printable ASCII
    characters, no blank), else :class:`InvalidMessage` naming ``field``."""
    if not isinstance(value, str):
        problem = f"an idempotency key must be a string, not {type(value).__name__}"
    elif not value:
        problem = "an idempotency key must not be empty"
    elif len(value) > MAX_ID_LENGTH:
        problem = f"an idempotency key is at most {MAX_ID_LENGTH} characters, not {len(value)}"
    elif _KEY.fullmatch(value) is None:
        position = next(i for i, ch in enumerate(value) if _KEY.fullmatch(ch) is None)
        problem = ("an idempotency key is printable ASCII without blanks (U+"
                   f"{ord(value[position]):04X} at character {position})")
    else:
        return value
    raise InvalidMessage(problem, field=field)


def check_session_id(value: Any, field: str = "session") -> str:
    return check_id(value, field=field, what="a session id")


def check_tenant(value: Any, field: str = "tenant") -> str:
    return check_id(value, field=field, what="a tenant name")


def check_count(value: Any, field: str, *, minimum: int = 0, maximum: int = MAX_INT32) -> int:
    """``value`` when it is a whole number (not a bool) from ``minimum`` to ``maximum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidMessage(f"must be a whole number, not {type(value).__name__}", field=field)
    if not minimum <= value <= maximum:
        raise InvalidMessage(f"must be a whole number from {minimum} to {maximum}, not {value}",
                             field=field)
    return value


def check_seconds(value: Any, field: str) -> float:
    """``value`` when it is a finite number of seconds above 0 (NaN would wait forever)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMessage(f"must be a number of seconds, not {type(value).__name__}",
                             field=field)
    if not math.isfinite(value) or value <= 0:
        raise InvalidMessage(f"must be a finite number of seconds above 0, not {value}",
                             field=field)
    return float(value)
