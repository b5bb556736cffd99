"""The recall tools as data: their schemas in OpenAI and Anthropic form, and the checks every
interface applies to their arguments before anything is read.

``history_search(query, checkpoint=None, limit=5)`` and ``history_read(checkpoint, offset=0)``
are offered to a model as tools (the LangChain middleware, ``compactd tools --json``,
``GET /v1/tools``) and called by code (client, CLI, HTTP). Both paths go through
:func:`check_search` / :func:`check_read` (or :func:`check_tool_call` for a model's raw call), so
a bad argument is refused the same way everywhere, with a :class:`RecallArgumentError` that names
it. The schemas state the same bounds, so a provider that validates them refuses what compactd
would.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from storage.recall_bounds import (
    DEFAULT_SEARCH_LIMIT,
    MAX_QUERY_BYTES,
    MAX_SEARCH_LIMIT,
    check_limit,
    check_offset,
    check_query,
)
from worker.compaction.recall import (
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
    "result), as a transcript. Long results are paginated: pass the returned next offset to "
    "continue.")
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
                   "description": "Where to continue: the next offset a previous read "
                                  "returned."},
    },
    "required": ["checkpoint"],
    "additionalProperties": False,
}
_TOOLS = ((HISTORY_SEARCH, _SEARCH_DESCRIPTION, _SEARCH_PARAMETERS),
          (HISTORY_READ, _READ_DESCRIPTION, _READ_PARAMETERS))
TOOL_NAMES = tuple(name for name, _, _ in _TOOLS)
FORMS = ("openai", "anthropic")
_DECIMAL = re.compile(r"[+-]?[0-9]{1,30}")


def tool_schemas(form: str = "openai") -> list[dict[str, Any]]:
    """The two tool definitions in ``form`` (a fresh copy: callers may edit it)."""
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


def check_search(query: Any, checkpoint: Any = None, limit: Any = DEFAULT_SEARCH_LIMIT
                 ) -> SearchArgs:
    """``history_search``'s arguments, checked; the first bad one raises."""
    query = check_query(query)
    ref = None if checkpoint is None else parse_ref(checkpoint, "checkpoint")
    return SearchArgs(query, ref, check_limit(_integer("limit", limit)))


def check_read(checkpoint: Any, offset: Any = 0) -> ReadArgs:
    """``history_read``'s arguments, checked; the first bad one raises."""
    if checkpoint is None:
        raise RecallArgumentError("checkpoint", "is required")
    ref = parse_ref(checkpoint, "checkpoint")
    return ReadArgs(ref, check_offset(_integer("offset", offset)))


def check_tool_call(name: str, arguments: str | dict[str, Any]) -> SearchArgs | ReadArgs:
    """A model's call of a recall tool (arguments as the JSON text or the decoded object)."""
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
    parameters = _SEARCH_PARAMETERS if name == HISTORY_SEARCH else _READ_PARAMETERS
    unknown = sorted(set(arguments) - set(parameters["properties"]))
    if unknown:
        raise RecallArgumentError(unknown[0], f"is not an argument of {name}")
    for required in parameters["required"]:
        if required not in arguments:
            raise RecallArgumentError(required, "is required")
    if name == HISTORY_SEARCH:
        return check_search(**arguments)
    return check_read(**arguments)


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
