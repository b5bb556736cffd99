"""The cyclomatic-complexity bound on compactd's own code (issue 28), read with radon.

Every function and method in storage/, worker/ and scheduler/ stays at or under
:data:`MAX_COMPLEXITY`, except those in :data:`ALLOWED`: functions over it today that another
branch is breaking up. An entry that is no longer over the bound is reported too, so it is
deleted when that branch merges.

    python tests/support/complexity.py     # exits 1 and lists what is over (ops/test runs it)
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from radon.complexity import cc_visit
from radon.visitors import Function

MAX_COMPLEXITY = 25
PACKAGES = ("storage", "worker", "scheduler")
ROOT = Path(__file__).resolve().parents[2]

# "path:qualified name" -> who is breaking it up. Delete an entry when its branch merges.
ALLOWED: dict[str, str] = {}


def _functions(blocks: Iterable[object], prefix: str = "") -> Iterator[tuple[str, int]]:
    for block in blocks:
        if isinstance(block, Function):
            name = prefix + block.fullname
            yield name, block.complexity
            yield from _functions(block.closures, name + ".")


def complexities(root: Path = ROOT) -> dict[str, int]:
    """Every function's complexity, by "path:qualified name" (closures under their parent)."""
    out: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            for name, value in _functions(cc_visit(source)):
                out[f"{path.relative_to(root).as_posix()}:{name}"] = value
    return out


def problems(found: dict[str, int], allowed: dict[str, str] = ALLOWED) -> list[str]:
    """Functions over the bound and not allowed, and allowed entries no longer over it."""
    over = [f"{name}: complexity {value} (over {MAX_COMPLEXITY}): break it up"
            for name, value in sorted(found.items())
            if value > MAX_COMPLEXITY and name not in allowed]
    stale = [f"{name}: allowed ({owner}) but now {found.get(name, 'gone')}: delete its entry "
             "in tests/support/complexity.py"
             for name, owner in sorted(allowed.items())
             if found.get(name, 0) <= MAX_COMPLEXITY]
    return over + stale


def main() -> int:
    found = problems(complexities())
    for line in found:
        print(f"complexity: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
