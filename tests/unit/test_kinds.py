"""The closed sets have one home, ``storage.kinds``: the SQL's literals are members of them, and no
production module spells a member as a literal where it means the member."""

from __future__ import annotations

import enum
import json
import re
from pathlib import Path

import pytest

from compactd.storage import kinds
from compactd.storage.kinds import (
    EVENT_KINDS,
    REPLACE_KINDS,
    FailureClass,
    ItemState,
    JobState,
    JournalKind,
    LayoutRole,
    LeadBy,
    ModelFailure,
    NodeKind,
    RunCause,
    RunStatus,
    SignalReason,
    Stage,
)
from compactd.worker.run import USAGE_KINDS

ROOT = Path(__file__).resolve().parents[2]
SETS: list[type[enum.StrEnum]] = [
    value for value in vars(kinds).values()
    if isinstance(value, type) and issubclass(value, enum.StrEnum) and value is not enum.StrEnum]
# The column a literal is compared with, or written to, and the words it may hold.
COLUMN_SETS: dict[str, frozenset[str]] = {
    "kind": frozenset(EVENT_KINDS),
    "status": frozenset(RunStatus),
    "failure_class": frozenset(FailureClass),
    "state": frozenset(ItemState) | frozenset(JobState),
    "trigger": frozenset(RunCause),
}
_COLUMN = "|".join(COLUMN_SETS)


def test_a_member_is_the_plain_string_it_names() -> None:
    assert RunStatus.COMMITTED == "committed" and str(RunStatus.COMMITTED) == "committed"
    assert f"{JournalKind.END}" == "compaction/end"
    assert json.dumps({"outcome": RunStatus.FAILED, FailureClass.BUSY: [Stage.PRUNE]}) == \
        '{"outcome": "failed", "busy": ["prune"]}'
    assert {"pressure": 1}[RunCause.PRESSURE] == 1  # hashes as its string
    assert set(REPLACE_KINDS) < set(NodeKind) and set(NodeKind) | set(JournalKind) == EVENT_KINDS


def test_the_module_holds_every_set_the_issue_names() -> None:
    assert set(SETS) == {NodeKind, JournalKind, RunStatus, FailureClass, ModelFailure, RunCause,
                         SignalReason, Stage, JobState, ItemState, LayoutRole, LeadBy}


# ------------------------------------------------------------------------------------------
# the SQL's literals


def _sql_sources() -> list[Path]:
    return sorted([*(ROOT / "storage" / "sql").rglob("*.sql"),
                   *(ROOT / "storage" / "migrations" / "versions").glob("*.py")])


def _strip_comments(text: str) -> str:
    return re.sub(r"--[^\n]*", "", text)


def _top_level_split(text: str) -> list[str]:
    parts, depth, current, quoted = [], 0, [], False
    for ch in text:
        if ch == "'":
            quoted = not quoted
        elif not quoted and ch == "(":
            depth += 1
        elif not quoted and ch == ")":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    parts.append("".join(current).strip())
    return parts


def _to_closing_paren(text: str) -> str:
    """``text`` up to the parenthesis that closes the one opened before it."""
    depth = 1
    for index, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[:index]
    return text


def _insert_literals(sql: str) -> list[tuple[str, str]]:
    """``(column, literal)`` for each literal an INSERT ... VALUES (...) or INSERT ... SELECT
    writes to a closed set's column."""
    out = []
    for m in re.finditer(r"INSERT\s+INTO\s+\w+\s*\(([^)]*)\)\s*(VALUES\s*\(|SELECT\b)", sql,
                         re.IGNORECASE):
        columns = [c.strip().lower() for c in m[1].split(",")]
        rest = sql[m.end():]
        if m[2].upper().startswith("VALUES"):
            body = _to_closing_paren(rest)
        else:
            body = re.split(r"\bFROM\b|;|\bRETURNING\b", rest, maxsplit=1,
                            flags=re.IGNORECASE)[0]
        for column, expr in zip(columns, _top_level_split(body), strict=False):
            literal = re.fullmatch(r"'([^']*)'(?:::\w+)?", expr)
            if column in COLUMN_SETS and literal:
                out.append((column, literal[1]))
    return out


def sql_literals(sql: str) -> list[tuple[str, str]]:
    """Every literal the SQL compares with, or writes to, a closed set's column, as
    ``(column, literal)``; a ``compaction/...`` literal anywhere counts as an event kind."""
    sql = _strip_comments(sql)
    found = [(m[1].lower(), m[2]) for m in re.finditer(
        rf"\b({_COLUMN})\s*(?:=|<>|!=)\s*'([^']*)'", sql, re.IGNORECASE)]
    for m in re.finditer(rf"\b({_COLUMN})\s+(?:NOT\s+)?IN\s*\(([^)]*)\)", sql, re.IGNORECASE):
        found += [(m[1].lower(), v) for v in re.findall(r"'([^']*)'", m[2])]
    found += _insert_literals(sql)
    found += [("kind", v) for v in re.findall(r"'(compaction/[^']*)'", sql)]
    return found


@pytest.mark.parametrize(("sql", "expected"), [
    ("WHERE e.kind IN ('checkpoint', 'pruned') AND r.status <> 'running'",
     [("kind", "checkpoint"), ("kind", "pruned"), ("status", "running")]),
    ("INSERT INTO events (session_id, seq, kind, payload) VALUES (p, s + 1, 'compaction/end', x)",
     [("kind", "compaction/end"), ("kind", "compaction/end")]),
    ("INSERT INTO events (session_id, seq, kind)\n    SELECT p, f(i, 'x'), 'message' FROM t;",
     [("kind", "message")]),
    ("-- status = 'ignored'\nUPDATE t SET state = 'done'", [("state", "done")]),
])
def test_the_sql_reader_finds_the_literals(sql: str, expected: list[tuple[str, str]]) -> None:
    assert sorted(sql_literals(sql)) == sorted(expected)


def test_every_literal_the_sql_compares_with_a_closed_set_is_a_member_of_it() -> None:
    found: dict[tuple[str, str], list[str]] = {}
    for path in _sql_sources():
        for column, literal in sql_literals(path.read_text()):
            found.setdefault((column, literal), []).append(str(path.relative_to(ROOT)))
    strays = {key: where for key, where in found.items() if key[1] not in COLUMN_SETS[key[0]]}
    assert not strays, f"literals that are no member of compactd.storage.kinds: {strays}"
    # The reader sees the functions' literals (else this test could not fail).
    assert {("kind", NodeKind.MESSAGE), ("kind", JournalKind.START), ("kind", JournalKind.END),
            ("status", RunStatus.RUNNING)} <= set(found), sorted(found)


def test_the_alerts_and_the_runbook_match_metric_labels_by_members() -> None:
    """The alert rules and the runbook's queries select the metrics' labels by value: a word
    that is no member would select nothing, silently."""
    usage = {kind.removesuffix("_tokens") for kind in USAGE_KINDS}
    labels = {"outcome": frozenset(RunStatus), "failure_class": frozenset(FailureClass),
              "trigger": frozenset(RunCause), "stage": frozenset(Stage),
              "kind": frozenset(ModelFailure) | usage}
    found = []
    for path in [*(ROOT / "ops" / "prometheus").rglob("*.y*ml"), ROOT / "ops" / "RUNBOOK.md"]:
        for m in re.finditer(r'\b(outcome|failure_class|trigger|stage|kind)\s*(?:=|!=|=~|!~)\s*'
                             r'\\?"([^"\\]*)', path.read_text()):
            found += [(m[1], value, path.name) for value in m[2].split("|") if value]
    assert [f for f in found if f[1] not in labels[f[0]]] == []
    assert ("failure_class", FailureClass.ABANDONED, "alerts.yaml") in found


# ------------------------------------------------------------------------------------------
# no literals of the sets in production code

_WORDS = sorted({member.value for cls in SETS for member in cls}, key=len, reverse=True)
_Q = r"""(["'])(?:""" + "|".join(re.escape(w) for w in _WORDS) + r""")\1"""
_Q2 = _Q.replace(r"\1", r"\2")
_NAMES = r"(?:outcome|status|failure_class|kind|journal_kind|state|item_state|trigger|reason)"
# Where a literal stands for a member: compared, tested for membership, given to a field that
# holds one, listed with another member, or passed to what takes one.
LITERAL_CONTEXTS = [
    re.compile(rf"(?:==|!=)\s*{_Q}"),
    re.compile(rf"{_Q}\s*(?:==|!=|\s(?:not\s+)?in\s)"),
    re.compile(rf"\b{_NAMES}\s*(?::[^=\n]*)?=\s*{_Q}"),
    re.compile(rf"[\"']{_NAMES}[\"']\s*:\s*{_Q}"),
    re.compile(rf"{_Q}\s*,\s*{_Q2}(?!\s*:)"),
    re.compile(rf"\bLiteral\[[^\]]*{_Q}"),
    re.compile(rf"\b(?:RunRequest\([^,()]+,|RunFailed\(|ProviderError\(|\.fail\((?:\w+,\s*)?"
               rf"|labels\(|\.append\(|kinds=\[)\s*{_Q}"),
    re.compile(r"[\"']compaction/\w+[\"']"),
]
# Lines where such a literal is something else: (path, text on the line, why).
ALLOWED = [
    ("scheduler/http/bodies.py", '"message"',
     "where in a request body an error is: the message, not a node kind"),
    ("worker/compaction/prompt.py", '_CHECKPOINT_KEYS = ("checkpoint", "summary"',
     "meta keys of a checkpoint message"),
    ("worker/compaction/policy.py", 'if "prune" in raw:', "the policy's prune section"),
]


def literal_hits(path: str, text: str) -> list[str]:
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if not any(pattern.search(code) for pattern in LITERAL_CONTEXTS):
            continue
        if any(path == where and snippet in line for where, snippet, _ in ALLOWED):
            continue
        hits.append(f"{path}:{number}: {line.strip()}")
    return hits


@pytest.mark.parametrize("line", [
    'if out.outcome == "committed":', "QUIET = ('busy', 'changed')",
    'raise RunFailed("summary", "every candidate failed")', 'kinds=["message"]',
    'status="committed", limit=3', 'RunRequest(info.id, "pressure")', '"kind": "checkpoint",',
    'reason: Literal["pressure", "step"] = "pressure"', 'labels("prune").inc()',
    'self.fail(candidate, "deadline", "late")', 'e = "compaction/end"',
])
def test_the_scan_finds_a_literal_member(line: str) -> None:
    assert literal_hits("worker/x.py", line)


@pytest.mark.parametrize("line", [
    'if meta.get("checkpoint"):', 'name = "commit"', 'if form == "durable_context":',
    'code == "context_length_exceeded"', '# outcome == "committed" in a comment',
    'payload = {"message": rep.payload}', 'extra={"action": "sweep", "enqueued": 3}',
])
def test_the_scan_passes_other_strings(line: str) -> None:
    assert not literal_hits("worker/x.py", line)


def test_no_production_module_spells_a_member_as_a_literal() -> None:
    hits = []
    for top in ("storage", "worker", "scheduler"):
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative == "storage/kinds.py" or relative.startswith("storage/migrations/"):
                continue
            hits += literal_hits(relative, path.read_text())
    assert not hits, "use the member of compactd.storage.kinds:\n" + "\n".join(hits)
