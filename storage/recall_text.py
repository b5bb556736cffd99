"""How recall compares text, the same on both backends: case folded by Unicode's lower case
(PostgreSQL's ``lower`` under a UTF-8 ctype; SQLite's own ``lower`` folds ASCII only, so its
searches call :func:`fold` as the SQL function ``compactd_fold``), the words a query is ranked
by, how ranked candidates are ordered, and the snippet a hit shows.

Pure functions: ``storage.database`` registers two of them on every SQLite connection, and
``storage.recall`` ranks with the others, so the order of hits is computed once, in Python, from
the same integers on either backend.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SNIPPET_BEFORE_CHARS = 80
SNIPPET_CHARS = 240
# The trigram index (FTS5 on SQLite, pg_trgm on PostgreSQL) finds substrings of three code
# points or more; a shorter word held as a substring says little about a message anyway.
SHORTEST_RANKED_WORD = 3
# A query pasted from a sentence ranks by its longest words; each word costs a statement.
MAX_RANKED_WORDS = 8
_WORD = re.compile(r"\w+")


def fold(text: str | None) -> str | None:
    """``text`` as searches compare it (Unicode lower case; a NUL stays a character)."""
    return None if text is None else text.lower()


def snippet(body: str | None, needles_json: str, before: int, width: int) -> str | None:
    """``width`` code points of ``body`` from ``before`` ahead of the first of the (folded)
    needles it holds, or from its start. SQLite calls this as ``compactd_snippet`` (its
    ``substr`` stops at a NUL); PostgreSQL's ``substr`` cuts the same window."""
    if body is None:
        return None
    folded = body.lower()
    found = [i for i in (folded.find(n) for n in json.loads(needles_json)) if i >= 0]
    start = max(0, min(found) - before) if found else 0
    return body[start:start + width]


def ranked_words(query: str) -> list[str]:
    """The folded words a query's ranked stage looks for: distinct, of
    :data:`SHORTEST_RANKED_WORD` code points or more, the :data:`MAX_RANKED_WORDS` longest (in
    the query's order). None for a query of one word: every message holding it holds the query,
    and is an exact hit already."""
    words = [w for w in dict.fromkeys(w.lower() for w in _WORD.findall(query))
             if len(w) >= SHORTEST_RANKED_WORD]
    if words == [query.strip().lower()]:
        return []
    if len(words) > MAX_RANKED_WORDS:
        kept = set(sorted(words, key=lambda w: (-len(w), words.index(w)))[:MAX_RANKED_WORDS])
        words = [w for w in words if w in kept]
    return words


@dataclass(frozen=True, slots=True)
class Candidate:
    seq: int
    held: int  # bit i: the message holds the query's ranked word i


def rank(candidates: Iterable[Candidate], words: Sequence[str], messages: int) -> list[int]:
    """The candidates' seqs, best first: most of the query's words held, then the rarer words
    held (each weighs log(1 + messages / the candidates holding it), an inverse document
    frequency), then the newest."""
    pool = list(candidates)
    holders = [sum(1 for c in pool if c.held >> i & 1) for i in range(len(words))]
    weight = [math.log1p(messages / n) if n else 0.0 for n in holders]

    def key(c: Candidate) -> tuple[int, float, int]:
        held = [i for i in range(len(words)) if c.held >> i & 1]
        return len(held), math.fsum(weight[i] for i in held), c.seq

    return [c.seq for c in sorted(pool, key=key, reverse=True)]
