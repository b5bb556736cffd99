"""Parsing the project's own source in a test.

CPython 3.11 keeps the AST converter's recursion depth in state shared by every thread
(python/cpython gh-106905, fixed from 3.12.4): when another thread parses at the same time (a
traceback formatted in a leftover thread of an earlier test parses its line to place the carets),
``ast.parse`` can fail with "AST constructor recursion depth mismatch" on valid source. The
parse is retried; a real syntax error is still raised at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

ATTEMPTS = 5


def parse_file(path: Path, filename: str | None = None) -> ast.Module:
    source = path.read_text(encoding="utf-8")
    for attempt in range(ATTEMPTS):
        try:
            return ast.parse(source, filename=filename or str(path))
        except SystemError as error:
            if "recursion depth mismatch" not in str(error) or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
