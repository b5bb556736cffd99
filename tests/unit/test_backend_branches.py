"""Where PostgreSQL and SQLite differ is the connectors' business (storage/connectors*), and no
other code asks which backend it is on: not by the dialect's name, not by ``is_sqlite``, not by a
URL's scheme, not by a connector method that answers None on one backend, and not by a
connector's capability flags.

Migrations build each backend's schema and are left out; the engines below the connectors
(storage/connectors_engines.py), the drivers' errors (storage/connectors_errors.py) and the
migrations' online changes (storage/connectors_migrations.py) are connectors' modules too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support.source import parse_file

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("storage", "worker", "scheduler")
# Members a caller would branch on: methods that answered None where the backend lacked a
# function or a notification channel, flags that said what the backend could do, and the
# suffix of a query's form.
CONNECTOR_BRANCHES = frozenset({
    "append_call", "claim_call", "commit_call", "encodes_appends", "listener", "locks_rows",
    "takes_arrays", "variant", "variant_suffix", "wait_for_row_lock"})
BACKEND_NAMES = frozenset({"sqlite", "postgresql", "postgres", "asyncpg", "aiosqlite"})
CONNECTOR_CLASSES = frozenset({"PostgresConnector", "SQLiteConnector"})


def backend_branches(root: Path) -> list[str]:
    """``path:line: what`` for each place outside storage/connectors* that asks which backend
    it is on."""
    found: list[str] = []
    for path in sorted(p for d in SCANNED for p in (root / d).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("storage/connectors", "storage/migrations/")):
            continue
        tree = parse_file(path, rel)
        found.extend(f"{rel}:{line}: {what}" for line, what in _branches(tree))
    return found


def _branches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in CONNECTOR_BRANCHES:
                yield node.lineno, f"connector member {node.attr}"
            elif node.attr == "name" and _named(node.value) == "dialect":
                yield node.lineno, "the dialect's name"
        elif isinstance(node, ast.Name) and node.id in {"is_sqlite", *CONNECTOR_CLASSES}:
            yield node.lineno, node.id
        elif isinstance(node, ast.alias) and node.name in {"is_sqlite", *CONNECTOR_CLASSES}:
            yield getattr(node, "lineno", 0), f"import of {node.name}"
        elif isinstance(node, ast.Compare) and any(
                _backend_name(c) for c in (node.left, *node.comparators)):
            yield node.lineno, "a comparison with a backend's name"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in {"startswith", "endswith"}
              and any(_backend_name(a, prefix=True) for a in node.args)):
            yield node.lineno, "a URL's scheme"


def _named(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _backend_name(node: ast.AST, *, prefix: bool = False) -> bool:
    if isinstance(node, ast.Tuple):
        return any(_backend_name(e, prefix=prefix) for e in node.elts)
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    value = node.value.lower()
    if prefix:
        return any(value.startswith(name) for name in BACKEND_NAMES)
    return value in BACKEND_NAMES


def test_no_code_outside_the_connectors_branches_on_the_backend() -> None:
    assert backend_branches(ROOT) == []


def test_the_scan_finds_each_form_of_branch(tmp_path: Path) -> None:
    forms = {
        "dialect": "if engine.dialect.name == 'sqlite':\n    pass\n",
        "is_sqlite": "from compactd.storage.database import is_sqlite\nok = is_sqlite(engine)\n",
        "scheme": "embedded = url.startswith('sqlite')\n",
        "call": "row = await db.claim_call(session_id=s)\n",
        "flag": "if db.takes_arrays:\n    pass\n",
        "variant": "rows = await db.fetch(db.variant('history_search_word'))\n",
        "class": "if isinstance(db, SQLiteConnector):\n    pass\n",
    }
    (tmp_path / "worker").mkdir()
    for name, text in forms.items():
        (tmp_path / "worker" / f"{name}.py").write_text(text)
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "connectors_x.py").write_text(forms["dialect"])
    (tmp_path / "scheduler").mkdir()
    found = backend_branches(tmp_path)
    assert {line.split(":")[0] for line in found} == {f"worker/{n}.py" for n in forms}
