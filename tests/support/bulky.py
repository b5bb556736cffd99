"""Large tool results, generated: what makes recall's index work hard."""

from __future__ import annotations

import random
import string


def high_entropy(size: int, seed: int = 26) -> str:
    """``size`` characters of distinct random tokens (a log of ids, hashes), one per line."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    lines, total = [], 0
    while total < size:
        line = "".join(rng.choices(alphabet, k=31))
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)[:size]


def access_log(size: int, seed: int, *, error_at: int = 70_000) -> str:
    """``size`` characters of a web server's log: few distinct words (under PostgreSQL's
    tsvector limit, so the code before issue 26 indexed it in the commit, slowly), with one
    line ``ERR-<seed>-lease-lost`` at ``error_at`` (past the head a pruned result keeps)."""
    rng = random.Random(seed)
    lines, total = [], 0
    while total < size:
        line = (f"2026-12-06T01:{rng.randrange(60):02d}:{rng.randrange(60):02d}Z "
                f"worker-{rng.randrange(32)} GET /api/items/{rng.randrange(5000)} "
                f"status={rng.choice((200, 200, 200, 404, 500))} took={rng.randrange(400)}ms")
        lines.append(line)
        total += len(line) + 1
    text = "\n".join(lines)
    return text[:error_at] + f"\nERR-{seed}-lease-lost\n" + text[error_at:size]
