"""The recall tools as data: their schemas in OpenAI and Anthropic form, and the checks every
interface applies to their arguments before anything is read.

``history_search(query, checkpoint=None, limit=5)``, ``history_read(checkpoint, offset=0)`` and
``compact_context(focus)`` (the agent's own request for a compaction, its focus the run's
instructions) are offered to a model as tools (the LangChain middleware, ``compactd tools --json``,
``GET /v1/tools``) and called by code (client, CLI, HTTP). Both paths go through
:func:`check_search` / :func:`check_read` (or :func:`check_tool_call` for a model's raw call), so
a bad argument is refused the same way everywhere, with a :class:`RecallArgumentError` that names
it. The schemas state the same bounds, so a provider that validates them refuses what compactd
would.

What a tool call returns to a model (:func:`search_result_text`, :func:`read_result_text`) is
composed here too, from the results' JSON, so every runtime that offers the tools can answer
them the same way.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compactd.storage.errors import InvalidMessage
from compactd.storage.instructions import MAX_INSTRUCTION_CHARS, check_instructions
from compactd.storage.recall_bounds import (
    DEFAULT_READ_TOKENS,
    DEFAULT_SEARCH_LIMIT,
    MAX_CURSOR_CHARS,
    MAX_QUERY_BYTES,
    MAX_READ_TOKENS,
    MAX_SEARCH_LIMIT,
    MIN_READ_TOKENS,
    check_budget_tokens,
    check_cursor,
    check_limit,
    check_offset,
    check_query,
)
from compactd.worker.compaction.recall import (
    HISTORY_READ,
    HISTORY_SEARCH,
    RecallArgumentError,
    Ref,
    parse_ref,
)

_SEARCH_DESCRIPTION = (
    "Search the original messages that compaction replaced in this session (checkpoints and "
    "pruned tool results). Exact substring matches (error text, ids, paths, values) rank above "
    "fuzzy ones. Each hit names its checkpoint, seq and a snippet.")
_READ_DESCRIPTION = (
    "Read the original messages a checkpoint replaced (or the original of a pruned tool "
    "result), as a transcript. A long read comes in pages; a page that is not the last ends "
    "with a cursor: pass it back as cursor to continue exactly where the page stopped (even "
    "inside a long message).")
_CHECKPOINT_DESCRIPTION = ("A checkpoint like c12-340 or a pruned tool result like r57, as "
                           "named in the conversation.")

_SEARCH_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_BYTES,
                  "description": "Text to find; exact strings work best."},
        "checkpoint": {"type": ["string", "null"],
                       "description": "Search only this checkpoint. " + _CHECKPOINT_DESCRIPTION},
        "limit": {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_LIMIT,
                  "default": DEFAULT_SEARCH_LIMIT, "description": "Most hits to return."},
    },
    "required": ["query"],
    "additionalProperties": False,
}
_READ_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "checkpoint": {"type": "string", "description": _CHECKPOINT_DESCRIPTION},
        "offset": {"type": "integer", "minimum": 0, "default": 0,
                   "description": "The index of the first original message to show (0: the "
                                  "first). To continue a page, pass its cursor instead."},
        "cursor": {"type": ["string", "null"], "minLength": 1, "maxLength": MAX_CURSOR_CHARS,
                   "description": "The cursor the previous page of this same checkpoint "
                                  "returned: the exact place to resume. Give offset or "
                                  "cursor, not both."},
        "budget_tokens": {"type": "integer", "minimum": MIN_READ_TOKENS,
                          "maximum": MAX_READ_TOKENS, "default": DEFAULT_READ_TOKENS,
                          "description": "Most tokens one page holds."},
    },
    "required": ["checkpoint"],
    "additionalProperties": False,
}
# The agent's own compaction: its handoff note becomes the run's instructions. Queued, never
# waited for; refused by the loop guard when asked for again and again.
COMPACT_CONTEXT = "compact_context"
_COMPACT_DESCRIPTION = (
    "Ask for this conversation's history to be compacted into a summary now (for example "
    "before a new phase of the task), with your own handoff note: what the summary must keep "
    "for you to continue. It runs in the background; your next step sees the summary. Do not "
    "call it every step: repeated calls are refused.")
_COMPACT_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "focus": {"type": "string", "minLength": 1, "maxLength": MAX_INSTRUCTION_CHARS,
                  "description": "The handoff note: the goal, decisions, open work and exact "
                                 "names the summary must keep."},
    },
    "required": ["focus"],
    "additionalProperties": False,
}
_TOOLS = ((HISTORY_SEARCH, _SEARCH_DESCRIPTION, _SEARCH_PARAMETERS),
          (HISTORY_READ, _READ_DESCRIPTION, _READ_PARAMETERS),
          (COMPACT_CONTEXT, _COMPACT_DESCRIPTION, _COMPACT_PARAMETERS))
_PARAMETERS = {name: parameters for name, _, parameters in _TOOLS}
TOOL_NAMES = tuple(name for name, _, _ in _TOOLS)
FORMS = ("openai", "anthropic")
_DECIMAL = re.compile(r"[+-]?[0-9]{1,30}")


def tool_schemas(form: str = "openai") -> list[dict[str, Any]]:
    """The tool definitions in ``form`` (a fresh copy: callers may edit it)."""
    if form == "openai":
        return [{"type": "function", "function": {
                    "name": name, "description": description,
                    "parameters": copy.deepcopy(parameters)}}
                for name, description, parameters in _TOOLS]
    if form == "anthropic":
        return [{"name": name, "description": description,
                 "input_schema": copy.deepcopy(parameters)}
                for name, description, parameters in _TOOLS]
    raise ValueError(f"unknown tool form {form!r} (have {', '.join(FORMS)})")


def tools_document() -> dict[str, list[dict[str, Any]]]:
    """What ``compactd tools --json`` and ``GET /v1/tools`` print: both forms, one source."""
    return {form: tool_schemas(form) for form in FORMS}


@dataclass(frozen=True, slots=True)
class SearchArgs:
    query: str
    checkpoint: Ref | None = None
    limit: int = DEFAULT_SEARCH_LIMIT


@dataclass(frozen=True, slots=True)
class ReadArgs:
    checkpoint: Ref
    offset: int = 0
    cursor: str | None = None
    budget_tokens: int = DEFAULT_READ_TOKENS


@dataclass(frozen=True, slots=True)
class CompactArgs:
    focus: str


def check_compact(focus: Any = None) -> CompactArgs:
    """``compact_context``'s argument, checked as a manual run's instructions are."""
    if focus is None:
        raise RecallArgumentError("focus", "is required")
    try:
        return CompactArgs(check_instructions(focus, "focus"))
    except InvalidMessage as exc:
        raise RecallArgumentError("focus", exc.reason) from None


def check_search(query: Any, checkpoint: Any = None, limit: Any = DEFAULT_SEARCH_LIMIT
                 ) -> SearchArgs:
    """``history_search``'s arguments, checked; the first bad one raises."""
    query = check_query(query)
    ref = None if checkpoint is None else parse_ref(checkpoint, "checkpoint")
    return SearchArgs(query, ref, check_limit(_integer("limit", limit)))


def check_read(checkpoint: Any, offset: Any = 0, cursor: Any = None,
               budget_tokens: Any = DEFAULT_READ_TOKENS) -> ReadArgs:
    """``history_read``'s arguments, checked; the first bad one raises. Whether a cursor
    belongs to ``checkpoint`` is known once storage decodes it."""
    if checkpoint is None:
        raise RecallArgumentError("checkpoint", "is required")
    ref = parse_ref(checkpoint, "checkpoint")
    at = check_offset(_integer("offset", offset))
    if cursor is not None:
        check_cursor(cursor)
        if at != 0:
            raise RecallArgumentError("cursor", "give offset or cursor, not both")
    return ReadArgs(ref, at, cursor, check_budget_tokens(_integer("budget_tokens",
                                                                  budget_tokens)))


def check_tool_call(name: str, arguments: str | dict[str, Any]
                    ) -> SearchArgs | ReadArgs | CompactArgs:
    """A model's call of one of the tools (arguments as the JSON text or the decoded
    object)."""
    if name not in TOOL_NAMES:
        raise RecallArgumentError("name", f"{name!r} is not a recall tool (have "
                                          f"{', '.join(TOOL_NAMES)})")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise RecallArgumentError("arguments", f"not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise RecallArgumentError("arguments", "must be a JSON object")
    parameters = _PARAMETERS[name]
    unknown = sorted(set(arguments) - set(parameters["properties"]))
    if unknown:
        raise RecallArgumentError(unknown[0], f"is not an argument of {name}")
    for required in parameters["required"]:
        if required not in arguments:
            raise RecallArgumentError(required, "is required")
    if name == HISTORY_SEARCH:
        return check_search(**arguments)
    if name == COMPACT_CONTEXT:
        return check_compact(**arguments)
    return check_read(**arguments)


def search_result_text(result: Mapping[str, Any]) -> str:
    """``history_search``'s answer to a model: the result's JSON (its hits, each naming the
    checkpoint to read, and how much was scanned), compact."""
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"))


def compact_result_text(queued: Mapping[str, Any]) -> str:
    """``compact_context``'s answer to a model: queued (or joined to the compaction already
    queued), and that the summary comes at a later step."""
    if queued.get("coalesced"):
        head = "A compaction of this conversation was already queued; your note was added to it."
    else:
        head = "Compaction queued."
    return (f"{head} It runs in the background: a later step shows the summary in place of "
            f"the older history. Go on with the task. (task {queued['task_id']})")


def read_result_text(page: Mapping[str, Any]) -> str:
    """``history_read``'s answer to a model: a line naming what the page shows, the transcript
    verbatim, and a last line with the call that continues it (or saying it was the last)."""
    ref, seqs, total = page["checkpoint"], page["seqs"], page["total_messages"]
    if seqs:
        head = f"[{ref} replaced {total} messages; this page: seqs {seqs[0]}-{seqs[-1]}]"
    else:
        head = f"[{ref} replaced {total} messages; none from offset {page['offset']}]"
    transcript = page["transcript"]
    if transcript and not transcript.endswith("\n"):
        transcript += "\n"
    if page["cursor"] is not None:
        tail = f'[more: {HISTORY_READ}(checkpoint="{ref}", cursor="{page["cursor"]}")]'
    else:
        tail = f"[end of {ref}]"
    return f"{head}\n{transcript}{tail}"


def _integer(argument: str, value: Any) -> int:
    """An integer, or a string of decimal digits (models often quote numbers)."""
    if isinstance(value, bool):
        raise RecallArgumentError(argument, f"must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        return int(value.strip())
    shown = repr(value) if len(repr(value)) <= 40 else type(value).__name__
    raise RecallArgumentError(argument, f"must be an integer, got {shown}")
