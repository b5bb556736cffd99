"""storage/sql is the one home of compactd's SQL: every named query is used by storage, and no
Python module outside the loader and the migrations holds statement text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from compactd.storage import sql

ROOT = Path(__file__).resolve().parents[2]
STORAGE = ROOT / "storage"
# Statement text as it would appear in a string literal (upper case, as the project writes it).
STATEMENT = re.compile(r"\b(SELECT|INSERT INTO|UPDATE \w+\s+SET|DELETE FROM|"
                       r"CREATE (OR REPLACE )?FUNCTION)\b")
# Revisions written before storage/sql existed keep the text they ran; 0004 and 0009 load it.
HISTORICAL = {"20261130_0002_append_function.py", "20261130_0003_claim_function.py",
              "20261201_0005_sweep_index.py", "20261201_0007_growth_rate.py",
              "20261201_0008_claim_waits.py"}


def _python(*packages: str) -> list[Path]:
    return [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))
            if ".venv" not in p.parts]


def test_every_named_query_is_used_in_storage() -> None:
    source = "\n".join(p.read_text(encoding="utf-8") for p in _python("storage")
                       if p != STORAGE / "sql" / "__init__.py")
    # A backend's form of a query is run by its base name (Connector.variant).
    unused = [name for name in sql.NAMES
              if f'"{re.sub(r"_(pg|sqlite)$", "", name)}"' not in source]
    assert not unused, f"named queries no storage module runs: {unused}"


@pytest.mark.parametrize("name", sorted({re.sub(r"_(pg|sqlite)$", "", n) for n in sql.NAMES
                                         if re.search(r"_(pg|sqlite)$", n)}))
def test_a_query_with_backend_forms_has_both_each_for_its_backend(name: str) -> None:
    assert f"{name}_pg" in sql.NAMES and f"{name}_sqlite" in sql.NAMES
    assert sql.postgres_only(f"{name}_pg") is not None and sql.sqlite_only(f"{name}_pg") is None
    assert sql.sqlite_only(f"{name}_sqlite") is not None
    assert sql.postgres_only(f"{name}_sqlite") is None


def test_the_unused_query_check_can_fail() -> None:
    source = (STORAGE / "store.py").read_text(encoding="utf-8")
    assert '"poll"' in source and '"no_such_query"' not in source


@pytest.mark.parametrize("name", sql.NAMES)
def test_a_postgres_only_query_says_why(name: str) -> None:
    reason = sql.postgres_only(name)
    text = sql.NAMED_TEXT[name]
    if reason is None:
        assert sql.sqlite_text(name) == text
        return
    assert len(reason.split()) >= 4, f"{name}: give the reason it runs on PostgreSQL only"
    with pytest.raises(KeyError, match="PostgreSQL only"):
        sql.sqlite_text(name)


@pytest.mark.parametrize("name", sql.NAMES)
def test_a_sqlite_only_query_says_why(name: str) -> None:
    reason = sql.sqlite_only(name)
    if reason is None:
        if sql.postgres_only(name) is None:
            assert sql.postgres_text(name) == sql.NAMED_TEXT[name]
            assert sql.positional(name)[0]
        return
    assert sql.postgres_only(name) is None, f"{name}: runs on neither backend"
    assert len(reason.split()) >= 4, f"{name}: give the reason it runs on SQLite only"
    for refused in (sql.postgres_text, sql.positional):
        with pytest.raises(KeyError, match="SQLite only"):
            refused(name)


def test_a_trigger_runs_the_named_statement_with_the_row_for_parameters() -> None:
    body = sql.as_trigger_body("recall_fts_drop", row="OLD")
    assert body == ("DELETE FROM recall_fts WHERE session_id = OLD.session_id"
                    " AND seq = OLD.seq")


def test_no_python_module_holds_statement_text() -> None:
    allowed = {STORAGE / "sql" / "__init__.py"}
    found = []
    for path in _python("storage", "worker", "scheduler"):
        if path in allowed or path.name in HISTORICAL:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if STATEMENT.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "SQL text outside storage/sql:\n" + "\n".join(found)


def test_the_statement_check_recognises_statements() -> None:
    for text in sql.NAMED_TEXT.values():
        assert STATEMENT.search(text), text
    assert STATEMENT.search(sql.function_definition("compactd_claim"))
