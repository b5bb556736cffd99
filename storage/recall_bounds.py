"""The bounds of the recall operations' arguments, checked the same way by storage (which
refuses before it reads) and by the tool-call checks of ``worker.compaction.recall_tools``
(which the policy package may import: no I/O here)."""

from __future__ import annotations

import re

from compactd.storage.errors import RecallArgumentError

DEFAULT_SEARCH_LIMIT = 5
MAX_SEARCH_LIMIT = 100
# A query is a needle (an error line, an id, a path), not a document; over this it is refused.
MAX_QUERY_BYTES = 8192
# Offsets land in 64-bit integer columns.
MAX_OFFSET = 2**63 - 1
# A read page's token budget: enough for one ordinary message at the low end, a bounded tool
# result at the high end.
DEFAULT_READ_TOKENS = 2000
MIN_READ_TOKENS = 64
MAX_READ_TOKENS = 100_000
# A cursor names a node and two positions (about 100 characters); anything much longer is not
# one, and is refused before it is decoded.
MAX_CURSOR_CHARS = 256
# What Python makes of bytes that are not UTF-8 (a command-line argument, a surrogate-escaped
# file name): no database can store or compare it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_query(query: object) -> str:
    if not isinstance(query, str):
        raise RecallArgumentError("query", f"must be a string, got {type(query).__name__}")
    if not query.strip():
        raise RecallArgumentError("query", "is empty")
    if "\x00" in query:
        raise RecallArgumentError("query", "contains a NUL character")
    lone = _LONE_SURROGATE.search(query)
    if lone is not None:
        raise RecallArgumentError("query", f"is not valid UTF-8 text (a lone surrogate, "
                                           f"U+{ord(lone.group()):04X}, at character "
                                           f"{lone.start()}: bytes that are not UTF-8?)")
    size = len(query.encode("utf-8"))
    if size > MAX_QUERY_BYTES:
        raise RecallArgumentError("query", f"is {size} bytes; at most {MAX_QUERY_BYTES} bytes "
                                           "(UTF-8) are searched")
    return query


def check_limit(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int):
        shown = repr(count) if len(repr(count)) <= 40 else type(count).__name__
        raise RecallArgumentError("limit", f"must be an integer, got {shown}")
    if not 1 <= count <= MAX_SEARCH_LIMIT:
        raise RecallArgumentError("limit", f"must be between 1 and {MAX_SEARCH_LIMIT}, got "
                                           f"{count}")
    return count


def check_offset(at: int) -> int:
    if at < 0:
        raise RecallArgumentError("offset", f"must be 0 or more, got {at}")
    if at > MAX_OFFSET:
        raise RecallArgumentError("offset", f"must be at most {MAX_OFFSET}, got {at}")
    return at


def check_budget_tokens(budget: int) -> int:
    if not MIN_READ_TOKENS <= budget <= MAX_READ_TOKENS:
        raise RecallArgumentError("budget_tokens", f"must be between {MIN_READ_TOKENS} and "
                                                   f"{MAX_READ_TOKENS}, got {budget}")
    return budget


def check_cursor(cursor: object, argument: str = "cursor") -> str:
    """A cursor's shape; which node it belongs to is storage's to judge, as it decodes it."""
    if not isinstance(cursor, str):
        raise RecallArgumentError(argument, f"must be the cursor string a page returned, got "
                                            f"{type(cursor).__name__}")
    if not cursor.strip():
        raise RecallArgumentError(argument, "is empty")
    if len(cursor) > MAX_CURSOR_CHARS:
        raise RecallArgumentError(argument, f"is {len(cursor)} characters; a cursor history_read "
                                            f"returned is at most {MAX_CURSOR_CHARS}")
    return cursor
