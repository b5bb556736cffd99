"""``local``: a model-free summarizer that writes the eight sections from the messages themselves.

It runs offline and is deterministic, so it is the embedded default (no model configured) and the
last resort when every model fails. It cannot paraphrase, so it extracts: the user's requests, the
file paths the session touched and what was done to them, the exceptions it hit and what followed
them, identifiers (ticket ids like ``BILL-1234``, ids passed to tools) and the numbers next to the
errors, the assistant's stated decisions, its last state and its next step. An existing summary
(given, or a checkpoint among the messages) is merged, not copied: its sections are parsed, still
valid facts are kept, and its "Current Work" and "Next Step" are replaced by newer ones.

Guarantees:

* The eight headings are always there, an empty section says ``(none)``.
* The text is at most ``max_tokens`` and strictly fewer tokens than the input (the messages with
  their framing, plus the existing summary), counted with ``counter``.
* Every file path and every exception type name that appears in a tool result is in the text
  (as :func:`find_paths` and :func:`find_exception_names` define them), and so is every one an
  existing summary carried. When the budget is too small even for those alone, the text keeps as
  many as fit: exception names before paths (they are few), each kind in order of first
  appearance, so the ones left out are the latest paths.
* If not even the eight empty headings fit, or nothing but them would, the input is too small to
  summarize: :class:`~worker.llm.errors.LocalSummaryError` is raised (the candidate fails
  rather than writing eight "(none)" for a range that had content).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from compactd.storage.messages import META_CHECKPOINT, META_PINNED, Message, ToolCall
from compactd.storage.tokens import TokenCounter, counter_for, fitting_prefix
from compactd.worker.compaction.policy import DEFAULT_MAX_SUMMARY_TOKENS
from compactd.worker.llm.errors import LocalSummaryError

SECTIONS = ("Primary Request and Intent", "Key Technical Concepts", "Files and Code",
            "Errors and Fixes", "Pending Jobs", "Current Work", "Next Step", "Critical Context")
EMPTY_SECTION = "(none)"
HEADING_PREFIX = "## "

REQUEST_CHARS = 300
ITEM_CHARS = 200
SHORT_ITEM_CHARS = 100
ERROR_LINE_CHARS = 160
MAX_DECISIONS = 6
MAX_CONCEPTS = 14
MAX_IDS = 24

# A file extension that a bare name (no slash) must carry to count as a file path; with a slash,
# any extension-looking suffix does. Without this list "os.path" or "self.assertEqual" would be
# "paths".
FILE_EXTENSIONS = frozenset({
    "py", "pyi", "pyx", "ipynb", "js", "jsx", "mjs", "cjs", "ts", "tsx", "json", "jsonl", "yaml",
    "yml", "toml", "ini", "cfg", "conf", "env", "md", "rst", "txt", "csv", "tsv", "html", "htm",
    "css", "scss", "sql", "sh", "bash", "zsh", "rs", "go", "java", "kt", "kts", "c", "h", "cc",
    "cpp", "cxx", "hpp", "cs", "rb", "php", "swift", "m", "mm", "r", "lua", "pl", "pm", "xml",
    "lock", "log", "proto", "tf", "vue", "svelte", "dart", "scala", "ex", "exs", "erl", "hs",
    "jl", "zig", "gradle", "properties", "patch", "diff", "dcm", "png", "jpg", "jpeg", "gif",
    "svg", "pdf", "whl", "gz", "tgz", "zip", "tar", "so", "dylib", "dll", "exe", "bin", "db",
    "sqlite",
})

_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
_PATH = re.compile(r"""
    (?<![\w/.@+~-])
    (?:
        (?:~|\.{1,2})?/(?:[\w.@+-]+/)*[\w.@+-]+      # /abs/path, ./rel, ../rel, ~/home
      | [\w@+-][\w.@+-]*(?:/[\w.@+-]+)+              # rel/path/with/slashes
      | [\w@+-][\w.@+-]*\.[A-Za-z][A-Za-z0-9]{0,7}   # bare.name with an extension
    )
    """, re.VERBOSE)
_EXT = re.compile(r"\.([A-Za-z][A-Za-z0-9]{0,7})$")
_EXCEPTION = re.compile(
    r"(?<![\w])(?:[A-Za-z_]\w*\.)*"
    r"([A-Z][A-Za-z0-9]*(?:Error|Exception|Warning)|KeyboardInterrupt|SystemExit"
    r"|StopIteration|StopAsyncIteration|GeneratorExit)(?![\w])")
_TICKET = re.compile(r"(?<![\w-])[A-Z][A-Z0-9]{1,9}-\d{2,}(?![\w-])")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_DECISION = re.compile(r"\b(I will|I'll|we will|we'll|decided|instead|let's|going to|the fix|"
                       r"root cause|should be|I am going|plan is|chose|switch(?:ed)? to)\b",
                       re.IGNORECASE)
_NEXT = re.compile(r"\b(next|then|now I|I will|I'll|let's|going to)\b", re.IGNORECASE)
_PENDING = re.compile(r"\b(TODO|still need|remaining|not yet|left to do|pending)\b",
                      re.IGNORECASE)
_CONCEPT = re.compile(r"`([^`\n]{2,40})`|\b([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+)\b"
                      r"|\b([A-Z][A-Z0-9]*_[A-Z0-9_]+)\b")
_EDIT_TOOL = re.compile(r"edit|write|replace|patch|create|insert|apply", re.IGNORECASE)
_HEADING = re.compile(r"^\s*(?:#+\s*)?(?:\d+[.)]\s*)?(?:\*\*)?\s*(" + "|".join(
    re.escape(s) for s in SECTIONS) + r")\s*(?:\*\*)?\s*:?\s*(?:\*\*)?\s*$",
    re.IGNORECASE | re.MULTILINE)


# --------------------------------------------------------------------------------------------
# fact finders (also the definitions the retention benchmark measures against)


def find_paths(text: str) -> list[str]:
    """File paths in ``text``, in order of first appearance.

    A path is an absolute (``/a/b``), home (``~/a``) or dot-relative (``./a``) path with at least
    two segments, a relative path with a slash whose last segment has an extension, or a bare
    file name with a known extension (:data:`FILE_EXTENSIONS`). URLs are not paths.
    """
    text = _URL.sub(" ", text)
    out: dict[str, None] = {}
    for match in _PATH.finditer(text):
        path = match.group(0).rstrip(".-")
        if _is_path(path):
            out.setdefault(path, None)
    return list(out)


def _is_path(path: str) -> bool:
    ext = _EXT.search(path)
    if "/" not in path:
        return bool(ext) and ext.group(1).lower() in FILE_EXTENSIONS  # type: ignore[union-attr]
    segments = [s for s in path.split("/") if s]
    if path.startswith(("/", "~/", "./", "../")):
        return len(segments) >= 2 and not all(s in (".", "..", "~") for s in segments)
    return bool(ext) and not path.startswith("-")


def find_exception_names(text: str) -> list[str]:
    """Exception type names (``KeyError``, ``marshmallow.ValidationError`` -> its last part),
    in order of first appearance."""
    out: dict[str, None] = {}
    for match in _EXCEPTION.finditer(text):
        out.setdefault(match.group(1), None)
    return list(out)


def tool_result_facts(messages: Iterable[Message]) -> tuple[list[str], list[str]]:
    """The file paths and exception names in the tool results of ``messages``: what the local
    summary must keep."""
    paths: dict[str, None] = {}
    errors: dict[str, None] = {}
    for message in messages:
        if message.role == "tool":
            text = message.text
            paths.update(dict.fromkeys(find_paths(text)))
            errors.update(dict.fromkeys(find_exception_names(text)))
    return list(paths), list(errors)


# --------------------------------------------------------------------------------------------
# extraction


@dataclass
class _PathInfo:
    actions: list[str] = field(default_factory=list)
    in_tool_result: bool = False

    def add(self, action: str) -> None:
        if action not in self.actions:
            self.actions.append(action)


@dataclass
class _ErrorInfo:
    line: str
    where: str | None
    index: int
    in_tool_result: bool
    fix: str | None = None
    recurred: bool = False


@dataclass
class _Facts:
    requests: list[str] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)
    paths: dict[str, _PathInfo] = field(default_factory=dict)
    errors: dict[str, _ErrorInfo] = field(default_factory=dict)
    ids: dict[str, None] = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    had_assistant: bool = False
    old_errors: dict[str, str] = field(default_factory=dict)
    tools: Counter[str] = field(default_factory=Counter)
    concepts: Counter[str] = field(default_factory=Counter)
    current: str | None = None
    next_step: str | None = None
    previous: list[str] = field(default_factory=list)


def _extract(messages: Sequence[Message]) -> _Facts:
    facts = _Facts()
    last_assistant = -1
    for i, message in enumerate(messages):
        if message.meta.get(META_CHECKPOINT):
            summary = message.meta.get("summary")
            facts.previous.append(summary if isinstance(summary, str) else message.text)
            continue
        text = message.text
        if message.role == "user":
            if message.meta.get(META_PINNED):
                facts.pinned.append(_clip(text, REQUEST_CHARS))
            elif text.strip():
                facts.requests.append(_clip(text, REQUEST_CHARS))
        elif message.role == "assistant":
            last_assistant = i
            _assistant(facts, i, message)
        elif message.role == "tool":
            _tool_result(facts, i, message)
        for path in find_paths(text):
            facts.paths.setdefault(path, _PathInfo())
        for ticket in _TICKET.findall(text):
            facts.ids.setdefault(ticket, None)
        if message.role != "tool":
            for name in find_exception_names(text):
                if name not in facts.errors:
                    facts.errors[name] = _ErrorInfo(_error_line(text, name), None, i, False)
    # The requests after the last assistant turn have not been answered yet.
    facts.unanswered = [
        _clip(m.text, ITEM_CHARS) for m in messages[last_assistant + 1:]
        if m.role == "user" and m.text.strip() and not m.meta.get(META_PINNED)
        and not m.meta.get(META_CHECKPOINT)]
    facts.pending.extend(facts.unanswered)
    if last_assistant >= 0:
        facts.had_assistant = True
        _last_state(facts, messages, last_assistant)
    return facts


def _assistant(facts: _Facts, index: int, message: Message) -> None:
    text = message.text
    for sentence in _sentences(text):
        if _DECISION.search(sentence):
            facts.decisions.append(_clip(sentence, ITEM_CHARS))
        if _PENDING.search(sentence):
            facts.pending.append(_clip(sentence, ITEM_CHARS))
    for match in _CONCEPT.finditer(text):
        term = next(g for g in match.groups() if g)
        if not find_paths(term):
            facts.concepts[term.strip()] += 1
    edited = [path for call in message.tool_calls for path in _tool_call(facts, call)]
    if edited or re.search(r"\bfix", text, re.IGNORECASE):
        # The first change after an error is recorded as how it was addressed.
        how = (f"edited {', '.join(edited)}" if edited else "") + (
            f" ({_clip(_first_sentence(text), 120)})" if text.strip() else "")
        for info in facts.errors.values():
            if info.fix is None and info.index < index and how.strip():
                info.fix = how.strip()


def _tool_call(facts: _Facts, call: ToolCall) -> list[str]:
    """One tool call's name, paths and identifiers into ``facts``; the paths it edited."""
    facts.tools[call.name] += 1
    action = "edited" if _EDIT_TOOL.search(call.name) else "read" if re.search(
        r"read|view|open|cat", call.name, re.IGNORECASE) else "used"
    edited = []
    for path in find_paths(call.arguments):
        facts.paths.setdefault(path, _PathInfo()).add(action)
        if action == "edited":
            edited.append(path)
    for value in _argument_ids(call.arguments):
        facts.ids.setdefault(value, None)
    return edited

def _tool_result(facts: _Facts, index: int, message: Message) -> None:
    text = message.text
    paths = find_paths(text)
    for path in paths:
        facts.paths.setdefault(path, _PathInfo()).in_tool_result = True
    for name in find_exception_names(text):
        info = facts.errors.get(name)
        if info is None:
            facts.errors[name] = _ErrorInfo(_error_line(text, name), _where(text, name, paths),
                                            index, True)
        else:
            info.in_tool_result = True
            if info.fix is not None:
                info.recurred = True


def _last_state(facts: _Facts, messages: Sequence[Message], last: int) -> None:
    message = messages[last]
    calls = ", ".join(f"{c.name}({_clip(_call_subject(c.arguments), 80)})"
                      for c in message.tool_calls)
    text = _clip(" ".join(message.text.split()), ITEM_CHARS)
    if calls:
        text = f"{text} (last tool calls: {calls})" if text else f"last tool calls: {calls}"
    facts.current = text or None
    for m in reversed(messages[max(0, last - 6):last + 1]):
        if m.role != "assistant":
            continue
        for sentence in reversed(_sentences(m.text)):
            if _NEXT.search(sentence):
                facts.next_step = _clip(sentence, ITEM_CHARS)
                return


def _argument_ids(arguments: str) -> list[str]:
    try:
        data = json.loads(arguments)
    except ValueError:
        return []
    out = []
    if isinstance(data, dict):
        for key, value in data.items():
            if (isinstance(value, str) and re.search(r"(?:^|_)(id|number)$", key, re.I)
                    and re.fullmatch(r"[\w.:-]{3,40}", value)):
                out.append(value)
    return out


def _call_subject(arguments: str) -> str:
    try:
        data = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(data, dict):
        for key in ("path", "file", "command", "cmd", "query"):
            if isinstance(data.get(key), str):
                return str(data[key])
        return ", ".join(f"{k}={v}" for k, v in data.items() if isinstance(v, str | int | float))
    return str(data)


def _error_line(text: str, name: str) -> str:
    best = None
    for line in text.splitlines():
        if name in line:
            stripped = line.strip()
            # "KeyError: 'x'" beats "raise KeyError(...)" beats a mention.
            if stripped.startswith(name) or re.match(r"^(?:E\s+)?[\w.]*" + name + ":", stripped):
                return _clip(stripped, ERROR_LINE_CHARS)
            best = best or stripped
    return _clip(best or name, ERROR_LINE_CHARS)


def _where(text: str, name: str, paths: list[str]) -> str | None:
    # The last path mentioned before the error's line is where it was raised (tracebacks list
    # the innermost frame last).
    position = text.find(name)
    before = [p for p in paths if 0 <= text.find(p) < position]
    return before[-1] if before else None


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text) if len(s.strip()) > 3]


def _first_sentence(text: str) -> str:
    sentences = _sentences(text)
    return sentences[0] if sentences else ""


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


# --------------------------------------------------------------------------------------------
# an existing summary


def parse_sections(summary: str) -> dict[str, list[str]] | None:
    """A summary's items by section, or None when it does not use the eight headings."""
    matches = list(_HEADING.finditer(summary))
    if not matches:
        return None
    canonical = {s.lower(): s for s in SECTIONS}
    out: dict[str, list[str]] = {}
    for n, match in enumerate(matches):
        end = matches[n + 1].start() if n + 1 < len(matches) else len(summary)
        body = summary[match.end():end]
        items = []
        for line in body.splitlines():
            item = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s+", "", line).strip()
            if item and item != EMPTY_SECTION:
                items.append(item)
        out.setdefault(canonical[match.group(1).lower()], []).extend(items)
    return out


# --------------------------------------------------------------------------------------------
# sections and fitting


@dataclass
class _Item:
    text: str
    priority: float
    keys: tuple[str, ...] = ()  # must-keep facts the item carries
    short: str | None = None    # a compact form that still carries every key


_TOOLS_LINE = re.compile(r"^tools used:\s*(.*)$", re.IGNORECASE)
_TERMS_LINE = re.compile(r"^terms:\s*(.*)$", re.IGNORECASE)
_IDS_LINE = re.compile(r"^identifiers:\s*(.*)$", re.IGNORECASE)
_TOOL_COUNT = re.compile(r"([\w.:-]+) x(\d+)")
_ACTIONS = re.compile(r"\(([a-z, ]+)\)\s*$")


def _merge_previous(facts: _Facts, previous: Sequence[str]) -> dict[str, list[_Item]]:
    """Fold older summaries into ``facts``, older facts first; return their other lines.

    Merge, not copy: paths, exceptions, tool counts, terms and identifiers join this range's;
    facts an older summary kept stay must-keep (they came from some tool result once, and
    dropping them now would lose them for good); its "Current Work" and "Next Step" give way to
    newer ones, and its pending jobs are dropped once the assistant has acted since.
    """
    extra: dict[str, list[_Item]] = {name: [] for name in SECTIONS}
    paths: dict[str, _PathInfo] = {}
    requests: list[str] = []
    ids: dict[str, None] = {}
    for raw in previous:
        parsed = parse_sections(raw)
        if parsed is None:
            keys = _carried(raw)
            extra["Critical Context"].append(_Item(
                "earlier summary: " + _clip(raw, 600), 35, keys, ", ".join(keys) or None))
            continue
        requests.extend(parsed.get("Primary Request and Intent", []))
        extra["Key Technical Concepts"].extend(
            _merge_concepts(facts, parsed.get("Key Technical Concepts", [])))
        extra["Files and Code"].extend(_merge_files(paths, parsed.get("Files and Code", [])))
        extra["Errors and Fixes"].extend(
            _merge_errors(facts, parsed.get("Errors and Fixes", [])))
        if not facts.had_assistant:
            extra["Pending Jobs"].extend(_old_item(x, 60) for x in parsed.get("Pending Jobs", []))
        for section in ("Current Work", "Next Step"):
            if not _has_new(facts, section):
                extra[section].extend(_old_item(x, 70) for x in parsed.get(section, []))
        extra["Critical Context"].extend(_merge_context(ids, parsed.get("Critical Context", [])))
    for path, info in facts.paths.items():
        merged = paths.setdefault(path, _PathInfo())
        merged.in_tool_result |= info.in_tool_result
        for action in info.actions:
            merged.add(action)
    facts.paths = paths
    facts.ids = {**ids, **facts.ids}
    facts.requests = list(dict.fromkeys([*requests, *facts.requests]))
    return extra


def _merge_concepts(facts: _Facts, lines: Sequence[str]) -> list[_Item]:
    """An older summary's tool counts and terms added to ``facts``; its other lines."""
    other = []
    for line in lines:
        if tools := _TOOLS_LINE.match(line):
            for name, count in _TOOL_COUNT.findall(tools.group(1)):
                facts.tools[name] += int(count)
        elif terms := _TERMS_LINE.match(line):
            for term in terms.group(1).split(", "):
                if term.strip():
                    facts.concepts[term.strip()] += 1
        else:
            other.append(_old_item(line, 30))
    return other


def _merge_files(paths: dict[str, _PathInfo], lines: Sequence[str]) -> list[_Item]:
    """An older summary's paths and their actions added to ``paths``; lines naming none."""
    other = []
    for line in lines:
        found = find_paths(line)
        if not found:
            other.append(_old_item(line, 30))
        actions = _ACTIONS.search(line)
        for path in found:
            info = paths.setdefault(path, _PathInfo(in_tool_result=True))
            for action in (actions.group(1).split(", ") if actions else ()):
                info.add(action.strip())
    return other


def _merge_errors(facts: _Facts, lines: Sequence[str]) -> list[_Item]:
    """An older summary's errors by exception name into ``facts``; lines naming none."""
    other = []
    for line in lines:
        names = find_exception_names(line)
        if names and names[0] not in facts.old_errors:
            facts.old_errors[names[0]] = line
        elif not names:
            other.append(_old_item(line, 30))
    return other


def _merge_context(ids: dict[str, None], lines: Sequence[str]) -> list[_Item]:
    """An older summary's identifiers added to ``ids``; its other context lines."""
    other = []
    for line in lines:
        if found_ids := _IDS_LINE.match(line):
            ids.update(dict.fromkeys(i.strip() for i in found_ids.group(1).split(",")
                                     if i.strip()))
        else:
            other.append(_old_item(line, 75 if line.startswith("pinned:") else 40))
    return other


def _carried(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*find_paths(text), *find_exception_names(text)]))


def _old_item(text: str, priority: float) -> _Item:
    keys = _carried(text)
    return _Item(text, priority, keys, ", ".join(keys) or None)


def _sections(facts: _Facts, previous: Sequence[str]) -> dict[str, list[_Item]]:
    """Every section's items: an older summary's first (:func:`_merge_previous`), then this
    range's."""
    s = _merge_previous(facts, previous)
    s["Primary Request and Intent"].extend(_request_items(facts))
    s["Key Technical Concepts"].extend(_concept_items(facts))
    s["Files and Code"].extend(_file_items(facts))
    s["Errors and Fixes"].extend(_error_items(facts))
    s["Pending Jobs"].extend(_pending_items(facts))
    s["Current Work"].extend(_current_items(facts))
    s["Next Step"].extend(_next_step_items(facts))
    s["Critical Context"].extend(_context_items(facts))
    for name in SECTIONS:  # an item an older summary and this range both state, once
        s[name] = _unique(s[name])
    return s


def _request_items(facts: _Facts) -> list[_Item]:
    # The first request matters most, later ones refine it.
    return [_Item(request, 90 if n == 0 else 60 - n * 0.01)
            for n, request in enumerate(facts.requests)]


def _concept_items(facts: _Facts) -> list[_Item]:
    items = []
    if facts.tools:
        tools = ", ".join(f"{name} x{count}" for name, count in sorted(
            facts.tools.items(), key=lambda kv: (-kv[1], kv[0])))
        items.append(_Item(f"tools used: {tools}", 45))
    concepts = [t for t, _ in sorted(facts.concepts.items(), key=lambda kv: (-kv[1], kv[0]))
                if t not in facts.errors and t not in facts.old_errors and t not in facts.ids]
    if concepts:
        items.append(_Item("terms: " + ", ".join(concepts[:MAX_CONCEPTS]), 40))
    return items


def _file_items(facts: _Facts) -> list[_Item]:
    items = []
    for n, (path, info) in enumerate(facts.paths.items()):
        label = f"{path} ({', '.join(info.actions)})" if info.actions else path
        required = info.in_tool_result
        items.append(_Item(label, (100 if required else 50) - n * 1e-4,
                           (path,) if required else (), path))
    return items


def _error_items(facts: _Facts) -> list[_Item]:
    errors: list[_Item] = []
    kept_old: set[str] = set()
    for name, line in facts.old_errors.items():
        new = facts.errors.get(name)
        if new is not None and new.fix and "no change followed yet" in line:
            continue  # the newer entry knows what followed
        kept_old.add(name)
        keys = tuple(find_exception_names(line))
        errors.append(_Item(line, 100, keys, ", ".join(keys)))
    for name, error in facts.errors.items():
        if name not in kept_old:
            errors.append(_error_item(name, error))
    for n, item in enumerate(errors):
        item.priority -= n * 1e-4
    return errors


def _error_item(name: str, error: _ErrorInfo) -> _Item:
    parts = [name]
    if error.where:
        parts.append(f"in {error.where}")
    if error.line and error.line != name:
        parts.append(f"- {error.line}")
    parts.append(f"-> then: {error.fix}" if error.fix else "-> no change followed yet")
    if error.recurred:
        parts.append("(seen again after the change)")
    keys = (name,) if error.in_tool_result else ()
    return _Item(" ".join(parts), 100 if error.in_tool_result else 70, keys, name)


def _pending_items(facts: _Facts) -> list[_Item]:
    return [_Item(job, 65 + n * 0.01) for n, job in enumerate(dict.fromkeys(facts.pending))]


def _current_items(facts: _Facts) -> list[_Item]:
    return [_Item(facts.current, 80)] if facts.current else []


def _next_step_items(facts: _Facts) -> list[_Item]:
    items = []
    if facts.unanswered:
        # A request nobody answered yet comes before whatever the assistant planned.
        items.append(_Item(f"answer the latest request: {facts.unanswered[-1]}", 80))
    if facts.next_step:
        items.append(_Item(facts.next_step, 78))
    return items


def _context_items(facts: _Facts) -> list[_Item]:
    items = [_Item(f"pinned: {pinned}", 75) for pinned in facts.pinned]
    if facts.ids:
        ids = list(facts.ids)[:MAX_IDS]
        items.append(_Item("identifiers: " + ", ".join(ids), 72))
    decisions = list(dict.fromkeys(facts.decisions))[-MAX_DECISIONS:]
    items.extend(_Item(f"decision: {decision}", 50 + n * 0.01)
                 for n, decision in enumerate(decisions))
    return items


def _unique(items: list[_Item]) -> list[_Item]:
    seen: set[str] = set()
    out = []
    for item in items:
        if item.text not in seen:
            seen.add(item.text)
            out.append(item)
    return out


def _has_new(facts: _Facts, section: str) -> bool:
    return bool(facts.current) if section == "Current Work" else bool(
        facts.next_step or facts.unanswered)


def _render(sections: dict[str, list[str]]) -> str:
    blocks = []
    for name in SECTIONS:
        lines = sections.get(name) or []
        body = "\n".join(f"- {line}" for line in lines) if lines else EMPTY_SECTION
        blocks.append(f"{HEADING_PREFIX}{name}\n{body}")
    return "\n\n".join(blocks)


@dataclass
class _Row:
    item: _Item
    text: str


class _Fitter:
    """Degrade the sections step by step until the text fits the budget.

    Steps, cheapest loss first: clip long items; drop optional items, lowest priority first;
    shorten must-keep items to their bare fact; join the bare facts of a section on one line;
    finally drop must-keep facts, the latest first. Token costs are estimated per line (the
    encodings split at newlines, so the sum is close) and the result is checked exactly.
    """

    def __init__(self, sections: dict[str, list[_Item]], budget: int,
                 counter: TokenCounter) -> None:
        self.sections = sections
        self.budget = budget
        self.counter = counter
        self._costs: dict[str, int] = {}

    def fit(self) -> str:
        budget = self.budget
        for _ in range(8):
            text = self._fit_estimated(budget)
            over = self.counter.count_text(text) - self.budget
            if over <= 0:
                if text == _render({}) and any(self.sections.values()):
                    # Eight "(none)" for an input that had content would drop it silently.
                    raise LocalSummaryError(
                        f"a budget of {self.budget} tokens leaves no room for any content")
                return text
            budget -= over + 2
        raise LocalSummaryError(f"cannot fit the summary in {self.budget} tokens")

    def _cost(self, line: str) -> int:
        cost = self._costs.get(line)
        if cost is None:
            cost = self._costs[line] = self.counter.count_text(f"- {line}\n")
        return cost

    def _fit_estimated(self, budget: int) -> str:
        base = self.counter.count_text(_render({}))
        if base > budget:
            raise LocalSummaryError(
                f"the eight empty sections need {base} tokens, the budget is {budget}")
        work = {name: [_Row(item, item.text) for item in items]
                for name, items in self.sections.items()}
        # The steps of the class docstring, cheapest loss first; the first that fits ends it.
        steps: list[Callable[[_Work], _Work]] = [
            lambda rows: _clipped(rows, ITEM_CHARS),
            lambda rows: _clipped(rows, SHORT_ITEM_CHARS),
            lambda rows: self._without_optional(rows, base, budget),
            _bare_facts,
            _joined_facts,
        ]
        for step in steps:
            if self._total(base, work) <= budget:
                return _render_rows(work)
            work = step(work)
        if self._total(base, work) <= budget:
            return _render_rows(work)
        return _render_rows(self._earliest_facts(work, budget - base))

    def _total(self, base: int, work: _Work) -> int:
        return base + sum(self._cost(row.text) for rows in work.values() for row in rows)

    def _without_optional(self, work: _Work, base: int, budget: int) -> _Work:
        """Optional items dropped, lowest priority first, until the rest fits."""
        optional = sorted((row.item.priority, name, n) for name, rows in work.items()
                          for n, row in enumerate(rows) if not row.item.keys)
        current = self._total(base, work)
        dropped: set[tuple[str, int]] = set()
        for _, name, n in optional:
            if current <= budget:
                break
            current -= self._cost(work[name][n].text)
            dropped.add((name, n))
        return {name: [row for n, row in enumerate(rows) if (name, n) not in dropped]
                for name, rows in work.items()}

    def _earliest_facts(self, work: _Work, room: int) -> _Work:
        """Last resort: keep the earliest facts that fit, the section with fewer first
        (exception names, a handful, before a directory listing's worth of paths)."""
        for name in sorted(SECTIONS, key=lambda n: sum(len(r.item.keys) for r in work[n])):
            rows = work.get(name) or []
            if not rows:
                continue
            kept: list[str] = []
            for key in rows[0].item.keys:
                if self._cost(", ".join([*kept, key])) > room:
                    break
                kept.append(key)
            room -= self._cost(", ".join(kept)) if kept else 0
            work[name] = [_Row(rows[0].item, ", ".join(kept))] if kept else []
        return work


_Work = dict[str, list[_Row]]


def _render_rows(work: _Work) -> str:
    return _render({name: [row.text for row in rows] for name, rows in work.items()})


def _clipped(work: _Work, limit: int) -> _Work:
    for rows in work.values():
        for row in rows:
            row.text = _clip_keeping(row.item, row.text, limit)
    return work


def _bare_facts(work: _Work) -> _Work:
    """Must-keep items shortened to their bare facts."""
    for rows in work.values():
        for row in rows:
            if row.item.short:
                row.text = row.item.short
    return work


def _joined_facts(work: _Work) -> _Work:
    """One line per section: the bare facts of its items, joined."""
    joined_work: _Work = {}
    for name, rows in work.items():
        keys = list(dict.fromkeys(k for row in rows for k in row.item.keys))
        joined = ", ".join(keys)
        joined_work[name] = [_Row(_Item(joined, 100, tuple(keys)), joined)] if keys else []
    return joined_work


def _clip_keeping(item: _Item, text: str, limit: int) -> str:
    clipped = _clip(text, limit)
    if all(key in clipped for key in item.keys):
        return clipped
    return item.short or text


# --------------------------------------------------------------------------------------------


def summarize_local(messages: Sequence[Message], *, existing_summary: str | None = None,
                    max_tokens: int = DEFAULT_MAX_SUMMARY_TOKENS,
                    counter: TokenCounter | None = None) -> str:
    """The eight-section summary of ``messages`` merged with ``existing_summary``.

    At most ``max_tokens`` and strictly fewer tokens than the input; see the module docstring.
    """
    counter = counter or counter_for(None)
    messages = list(messages)
    facts = _extract(messages)
    previous = ([existing_summary] if existing_summary and existing_summary.strip() else [])
    previous += facts.previous
    input_tokens = sum(counter.count_message(m) for m in messages) + sum(
        counter.count_text(p) for p in ([existing_summary] if existing_summary else []))
    budget = min(max_tokens, input_tokens - 1)
    sections = _sections(facts, previous)
    if not any(sections.values()):
        # Eight empty sections carry nothing and are refused as a summary of a range with
        # history; text no rule extracted (a system note, a result without its call) is still
        # what the range said.
        last = next((m.text for m in reversed(messages) if m.text.strip()), "")
        if last.strip():
            sections["Critical Context"].append(_Item(_clip(" ".join(last.split()),
                                                            ITEM_CHARS), 10))
    return _Fitter(sections, budget, counter).fit()


# --------------------------------------------------------------------------------------------
# index entries (the recallable layout)

INDEX_ITEMS = 4
INDEX_CLIP_CHARS = 100


def summarize_local_index(messages: Sequence[Message], *, existing_summary: str | None = None,
                          max_tokens: int = DEFAULT_MAX_SUMMARY_TOKENS,
                          counter: TokenCounter | None = None) -> str:
    """A short what-happened of ``messages`` for an index checkpoint: what was asked, the errors
    met, the tools run, the files touched, where it ended; no sections. ``existing_summary`` is the
    entry an earlier call wrote for the same chunk, continued. At most ``max_tokens`` and
    strictly fewer tokens than the input; the most telling parts are kept first."""
    counter = counter or counter_for(None)
    messages = list(messages)
    facts = _extract(messages)
    parts: list[str] = []
    if existing_summary and existing_summary.strip():
        parts.append(_clip(" ".join(existing_summary.split()), INDEX_CLIP_CHARS * 2))
    if facts.requests:
        parts.append(f"Asked: {_clip(' '.join(facts.requests[0].split()), INDEX_CLIP_CHARS)}.")
    if facts.errors:
        parts.append(f"Errors: {', '.join(list(facts.errors)[:INDEX_ITEMS])}.")
    if facts.tools:
        ran = ", ".join(f"{name} x{n}" if n > 1 else name
                        for name, n in facts.tools.most_common(INDEX_ITEMS))
        parts.append(f"Ran {ran}.")
    if facts.paths:
        parts.append(f"Files: {', '.join(list(facts.paths)[:INDEX_ITEMS])}.")
    if facts.decisions:
        parts.append(f"Decided: {_clip(facts.decisions[-1], INDEX_CLIP_CHARS)}")
    if facts.current:
        parts.append(f"Last: {_clip(facts.current, INDEX_CLIP_CHARS)}")
    if not parts:
        noun = "message" if len(messages) == 1 else "messages"
        parts.append(f"{len(messages)} {noun} without text.")
    input_tokens = sum(counter.count_message(m) for m in messages) + (
        counter.count_text(existing_summary) if existing_summary else 0)
    budget = min(max_tokens, input_tokens - 1)
    text = ""
    for part in parts:
        joined = f"{text} {part}".strip()
        if counter.count_text(joined) > budget:
            continue
        text = joined
    if not text:
        text = parts[0][:fitting_prefix(parts[0], budget, counter)].strip()
    if not text:
        raise LocalSummaryError(f"no index entry fits {budget} tokens")
    return text
