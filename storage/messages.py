"""The message model and the importers of the three wire shapes runtimes speak.

A :class:`Message` is what an agent runtime appends: OpenAI chat roles, content as text or a list
of blocks (text and image blocks understood, others kept opaque), assistant tool calls, tool results
with the id of their call, and a free ``meta`` mapping for flags such as ``pinned`` (but for the
keys only compactd writes, :data:`RESERVED_META`).

Importers turn OpenAI chat dicts (the default and the shape of ``compactd ingest`` files),
Anthropic Messages dicts (``tool_use`` / ``tool_result`` blocks) and LangChain message dicts into
messages; :func:`check_message` holds a runtime's own :class:`Message` to the same rules. Every
rejection is an :class:`InvalidMessage` naming the field; file readers add the line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from compactd.storage.errors import InvalidMessage

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
FORMATS: tuple[str, ...] = ("openai", "anthropic", "langchain")

# Flags the pipeline reads from ``meta``; any other key is kept as the runtime sent it.
META_PINNED = "pinned"
META_REMINDER = "dynamic_context_reminder"
META_HIDDEN = "hide_from_ui"
META_SKILL = "skill_context_entry"
META_CHECKPOINT = "checkpoint"
META_PRUNED = "pruned"
META_RECALL = "recall"

# The deepest an array or object may sit inside one message field (content, meta, tool
# arguments given as an object). Real content is a few levels deep; the bound keeps every read
# of a stored message (the HTTP API's encoder stops near 255 levels, Python's json near 1000)
# far from the limits of the code that serves it back.
MAX_NESTING_DEPTH = 100

MAX_ID_CHARS = 255  # a tool-call id, as the tool_calls table holds it

TOO_DEEP = (f"JSON nested too deep to read (a message may nest at most {MAX_NESTING_DEPTH} "
            "levels)")

# Keys only compactd writes, on the nodes a compaction commits: the checkpoint flag, its summary,
# skills and render form, the authority contract's flag, the run that wrote it, the pruning
# marks, the recall reference a footer names. A runtime that sends one is refused: a message
# carrying them would be rendered, counted or summarized as compactd's own work (a fake
# checkpoint, a result never pruned, a footer pointing elsewhere). A unit test holds this set
# to the keys the worker writes.
RESERVED_META = frozenset({META_CHECKPOINT, "summary", "skills", "render", "authority_contract",
                           "run_id", META_PRUNED, "cleared", "cleared_tool_inputs",
                           "cleared_thinking", META_RECALL})


class ToolCall(BaseModel):
    """One function call an assistant message asks for. ``arguments`` is the JSON text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    name: str
    arguments: str = "{}"

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Message(BaseModel):
    """One message of a conversation, in compactd's own (OpenAI-like) shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    @property
    def text(self) -> str:
        """The message's text: the string content, or its text blocks joined."""
        return content_text(self.content)

    def flag(self, key: str) -> bool:
        return bool(self.meta.get(key))

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat dict of this message (``meta`` included when set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return self._with_optional_fields(out)

    def _with_optional_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """``out`` with the fields a message may leave unset, where set (both forms name them
        alike)."""
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.meta:
            out["meta"] = self.meta
        return out

    def to_payload(self) -> dict[str, Any]:
        """The compact dict stored in the event log (the inverse of :func:`from_payload`)."""
        out: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [[c.id, c.name, c.arguments] for c in self.tool_calls]
        return self._with_optional_fields(out)


def without_reserved(payload: dict[str, Any]) -> dict[str, Any]:
    """An appended message's payload without :data:`RESERVED_META` keys: a row appended before
    they were refused must still never read as a checkpoint or a pruned result."""
    meta = payload.get("meta")
    if not meta or RESERVED_META.isdisjoint(meta):
        return payload
    return {**payload, "meta": {k: v for k, v in meta.items() if k not in RESERVED_META}}


def from_payload(payload: Mapping[str, Any]) -> Message:
    """Rebuild a stored message without re-validating it (it was validated when appended)."""
    raw_calls = payload.get("tool_calls")
    calls = tuple(_constructed(ToolCall, {"id": c[0], "name": c[1], "arguments": c[2]})
                  for c in raw_calls) if raw_calls else ()
    return _constructed(Message, {
        "role": payload["role"], "content": payload.get("content"), "tool_calls": calls,
        "tool_call_id": payload.get("tool_call_id"), "name": payload.get("name"),
        "meta": dict(payload.get("meta") or {})})


_set_attribute = object.__setattr__
_M = TypeVar("_M", ToolCall, Message)


def _constructed(cls: type[_M], values: dict[str, Any]) -> _M:
    """``cls.model_construct(**values)`` for a model without private attributes or extras,
    given every field: what model_construct sets, without its per-field loop over defaults
    and aliases. A worker rebuilds every message of a surface per compaction and this halves
    the cost (a unit test holds it equal to model_construct)."""
    model = cls.__new__(cls)
    _set_attribute(model, "__dict__", values)
    _set_attribute(model, "__pydantic_fields_set__", set(values))
    _set_attribute(model, "__pydantic_extra__", None)
    _set_attribute(model, "__pydantic_private__", None)
    return model


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(b.get("text", "")) for b in content if b.get("type") == "text")


# --------------------------------------------------------------------------------------------
# Validation shared by the importers


def _check_text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidMessage(f"must be a string, got {type(value).__name__}", field=field)
    _check_utf8(value, field)
    return value


def _check_utf8(value: str, field: str) -> None:
    # json.loads accepts lone surrogate escapes such as "\ud800"; they are not valid UTF-8 and
    # PostgreSQL, the SDKs and every provider would reject them later, far from the cause.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessage(
            f"text is not valid UTF-8 (lone surrogate at offset {exc.start})", field=field
        ) from None


def check_json(value: Any, field: str, depth: int = 1, top: str | None = None) -> None:
    """``value`` (a message field, or what a runtime sends besides messages: a session's
    envelope and policy) is JSON every reader can serve back: strings (keys too) valid UTF-8,
    finite numbers, arrays and objects nested at most :data:`MAX_NESTING_DEPTH` levels
    (``depth`` is the level ``value`` sits at, ``top`` the field the walk began at, which a
    too-deep value is reported at)."""
    if isinstance(value, str):
        _check_utf8(value, field)
        return
    if value is None or isinstance(value, int):  # bool is an int
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMessage("must be a finite number (JSON has no NaN or Infinity)",
                                 field=field)
        return
    is_list = isinstance(value, list | tuple)
    if not is_list and not isinstance(value, dict | Mapping):
        raise InvalidMessage(f"must be a JSON value, got {type(value).__name__}", field=field)
    if depth > MAX_NESTING_DEPTH:
        raise InvalidMessage(f"is nested more than {MAX_NESTING_DEPTH} levels deep",
                             field=top or field)
    if is_list:
        for i, item in enumerate(value):
            check_json(item, f"{field}[{i}]", depth + 1, top or field)
        return
    for key, item in value.items():
        if not isinstance(key, str):
            raise InvalidMessage("object keys must be strings", field=field)
        _check_utf8(key, field)
        check_json(item, f"{field}.{key}", depth + 1, top or field)


def _check_id(value: Any, field: str, missing: str) -> str:
    """A tool-call id: what the ``tool_calls`` table holds as text of at most
    :data:`MAX_ID_CHARS` characters, where PostgreSQL cannot store a NUL."""
    if not isinstance(value, str) or not value:
        raise InvalidMessage(missing, field=field)
    _check_utf8(value, field)
    if "\x00" in value:
        raise InvalidMessage("must not contain a NUL character (U+0000)", field=field)
    if len(value) > MAX_ID_CHARS:
        raise InvalidMessage(f"must be at most {MAX_ID_CHARS} characters, got {len(value)}",
                             field=field)
    return value


def _check_content(value: Any, field: str = "content") -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        if value is not None:
            _check_utf8(value, field)
        return value
    if not isinstance(value, list):
        raise InvalidMessage(
            f"must be text or a list of blocks, got {type(value).__name__}", field=field)
    blocks: list[dict[str, Any]] = []
    for i, block in enumerate(value):
        where = f"{field}[{i}]"
        if isinstance(block, str):
            block = {"type": "text", "text": block}
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise InvalidMessage("a content block must be an object with a string 'type'",
                                 field=where)
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise InvalidMessage(f"must be a string, got {type(block.get('text')).__name__}",
                                 field=f"{where}.text")
        # Level 2: the content list is level 1 of the message's JSON.
        check_json(block, where, depth=2)
        blocks.append(dict(block))
    return blocks


def _check_meta(value: Any, field: str = "meta") -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidMessage(f"must be an object, got {type(value).__name__}", field=field)
    _check_not_reserved(value, field)
    check_json(value, field)
    return dict(value)


def _check_not_reserved(value: Mapping[str, Any], field: str) -> None:
    if RESERVED_META.isdisjoint(value):
        return
    key = min(RESERVED_META.intersection(value))
    raise InvalidMessage("is set only by compactd (on the checkpoints and pruned results a "
                         "compaction commits), never by a runtime", field=f"{field}.{key}")


def _arguments_text(value: Any, field: str) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        return _check_text(value, field)
    if isinstance(value, Mapping):
        check_json(value, field)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    raise InvalidMessage("must be a JSON string or an object", field=field)


def _make(role: Any, **fields: Any) -> Message:
    if role not in ROLES:
        raise InvalidMessage(f"unknown role {role!r} (expected one of {', '.join(ROLES)})",
                             field="role")
    calls = fields.get("tool_calls") or ()
    if calls and role != "assistant":
        raise InvalidMessage("only assistant messages carry tool calls", field="tool_calls")
    if role == "tool":
        _check_id(fields.get("tool_call_id"), "tool_call_id",
                  "a tool result needs the id of its tool call")
    elif fields.get("tool_call_id") is not None:
        raise InvalidMessage("only tool results carry a tool_call_id", field="tool_call_id")
    name = fields.get("name")
    if name is not None:
        _check_text(name, "name")
    seen: set[str] = set()
    for i, call in enumerate(calls):
        if call.id in seen:
            raise InvalidMessage(f"tool call id {call.id!r} is used twice in one message",
                                 field=f"tool_calls[{i}].id")
        seen.add(call.id)
    return Message(role=role, **fields)


def check_message(message: Message) -> Message:
    """A :class:`Message` the runtime built itself, checked as the importers check the dicts
    they parse (it passed through none of them): the same rules, the same field names."""
    for i, call in enumerate(message.tool_calls):
        where = f"tool_calls[{i}]"
        _check_id(call.id, f"{where}.id", "a tool call needs a non-empty string id")
        _check_text(call.name, f"{where}.function.name")
        _check_text(call.arguments, f"{where}.function.arguments")
    if message.tool_call_id is not None:
        _check_text(message.tool_call_id, "tool_call_id")
    return _make(message.role, content=_check_content(message.content),
                 tool_calls=message.tool_calls, tool_call_id=message.tool_call_id,
                 name=message.name, meta=_check_meta(message.meta))


# --------------------------------------------------------------------------------------------
# OpenAI chat shape (the default)

_OPENAI_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name", "meta"}
# Keys the OpenAI API itself returns on assistant messages; kept in meta rather than refused.
_OPENAI_PASSTHROUGH = {"refusal", "reasoning_content", "audio", "annotations", "function_call"}


def parse_openai(obj: Any) -> Message:
    """One OpenAI chat message dict (plus compactd's optional ``meta``)."""
    if not isinstance(obj, Mapping):
        raise InvalidMessage(f"a message must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _OPENAI_KEYS - _OPENAI_PASSTHROUGH
    if unknown:
        raise InvalidMessage(f"unknown field (expected {', '.join(sorted(_OPENAI_KEYS))})",
                             field=sorted(unknown)[0])
    meta = _check_meta(obj.get("meta"))
    for key in _OPENAI_PASSTHROUGH & set(obj):
        if obj[key] is not None:
            check_json(obj[key], key)
            meta.setdefault(key, obj[key])
    calls: list[ToolCall] = []
    raw_calls = obj.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise InvalidMessage("must be a list", field="tool_calls")
    for i, raw in enumerate(raw_calls or ()):
        where = f"tool_calls[{i}]"
        if not isinstance(raw, Mapping):
            raise InvalidMessage("must be an object", field=where)
        function = raw.get("function")
        fn: Mapping[str, Any] = function if isinstance(function, Mapping) else raw
        call_id = _check_id(raw.get("id"), f"{where}.id", "a tool call needs a non-empty string id")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidMessage("a tool call needs a function name",
                                 field=f"{where}.function.name")
        _check_utf8(name, f"{where}.function.name")
        calls.append(ToolCall(id=call_id, name=name,
                              arguments=_arguments_text(fn.get("arguments"),
                                                        f"{where}.function.arguments")))
    result_id = obj.get("tool_call_id")
    if result_id is not None:
        _check_text(result_id, "tool_call_id")
    return _make(obj.get("role"), content=_check_content(obj.get("content")),
                 tool_calls=tuple(calls), tool_call_id=result_id, name=obj.get("name"), meta=meta)


# --------------------------------------------------------------------------------------------
# Anthropic Messages shape


def parse_anthropic(obj: Any) -> list[Message]:
    """One Anthropic message; a user turn of ``tool_result`` blocks becomes tool messages."""
    if not isinstance(obj, Mapping):
        raise InvalidMessage(f"a message must be a JSON object, got {type(obj).__name__}")
    role = obj.get("role")
    meta = _check_meta(obj.get("meta"))
    content = obj.get("content")
    if role not in ("user", "assistant", "system"):
        raise InvalidMessage(f"unknown role {role!r} (expected user, assistant or system)",
                             field="role")
    if content is None or isinstance(content, str):
        return [_make(role, content=_check_content(content), meta=meta)]
    if not isinstance(content, list):
        raise InvalidMessage("must be text or a list of blocks", field="content")
    kept: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for i, block in enumerate(content):
        where = f"content[{i}]"
        if not isinstance(block, Mapping):
            raise InvalidMessage("a content block must be an object", field=where)
        kind = block.get("type")
        if kind == "tool_use":
            if role != "assistant":
                raise InvalidMessage("tool_use blocks belong to assistant messages", field=where)
            call_id = _check_id(block.get("id"), f"{where}.id", "a tool_use block needs an id")
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidMessage("a tool_use block needs a name", field=f"{where}.name")
            _check_utf8(name, f"{where}.name")
            calls.append(ToolCall(id=call_id, name=name,
                                  arguments=_arguments_text(block.get("input"), f"{where}.input")))
        elif kind == "tool_result":
            if role != "user":
                raise InvalidMessage("tool_result blocks belong to user messages", field=where)
            call_id = _check_id(block.get("tool_use_id"), f"{where}.tool_use_id",
                                "a tool_result block needs a tool_use_id")
            result_meta = {"is_error": True} if block.get("is_error") else {}
            results.append(_make("tool", content=_check_content(block.get("content"),
                                                                f"{where}.content"),
                                 tool_call_id=call_id, meta=result_meta))
        else:
            checked = _check_content([block], "content")
            assert checked is not None and not isinstance(checked, str)
            kept.extend(checked)
    out = list(results)
    if kept or calls or not results:
        out.append(_make(role, content=kept or None, tool_calls=tuple(calls), meta=meta))
    elif meta and out:
        out[-1] = out[-1].model_copy(update={"meta": {**out[-1].meta, **meta}})
    return out


# --------------------------------------------------------------------------------------------
# LangChain message dicts (``message.model_dump()`` or ``messages_to_dict`` output)

_LANGCHAIN_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
                    "HumanMessage": "user", "AIMessage": "assistant",
                    "SystemMessage": "system", "ToolMessage": "tool"}


def parse_langchain(obj: Any) -> Message:
    """One LangChain message dict: ``{"type": "human", ...}`` or ``{"type", "data": {...}}``."""
    if not isinstance(obj, Mapping):
        raise InvalidMessage(f"a message must be a JSON object, got {type(obj).__name__}")
    data = obj["data"] if isinstance(obj.get("data"), Mapping) else obj
    kind = obj.get("type", data.get("type"))
    role = _LANGCHAIN_ROLES.get(kind) if isinstance(kind, str) else None
    if role is None:
        raise InvalidMessage(f"unknown message type {kind!r} (expected human, ai, system, tool)",
                             field="type")
    calls: list[ToolCall] = []
    for i, raw in enumerate(data.get("tool_calls") or ()):
        where = f"tool_calls[{i}]"
        if not isinstance(raw, Mapping):
            raise InvalidMessage("must be an object", field=where)
        _check_id(raw.get("id"), f"{where}.id", "a tool call needs a non-empty string id")
        if not isinstance(raw.get("name"), str) or not raw["name"]:
            raise InvalidMessage("a tool call needs a name", field=f"{where}.name")
        _check_utf8(raw["name"], f"{where}.name")
        calls.append(ToolCall(id=raw["id"], name=raw["name"],
                              arguments=_arguments_text(raw.get("args"), f"{where}.args")))
    meta = langchain_meta(data)
    call_id = data.get("tool_call_id")
    if call_id is not None:
        _check_text(call_id, "tool_call_id")
    name = data.get("name")
    return _make(role, content=_check_content(data.get("content")), tool_calls=tuple(calls),
                 tool_call_id=call_id, name=name if role == "tool" or name else None, meta=meta)


def langchain_meta(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``meta`` a LangChain message carries: its ``additional_kwargs`` (where runtimes
    such as DeerFlow tag reminders, hidden messages and skill reads), a ``meta`` of its own on
    top, and a ToolMessage's ``status: error`` as ``is_error``. ``compactd ingest --format
    langchain`` and ``CompactdMiddleware`` both read flags through here, so a transcript
    compacts the same way whichever path stored it."""
    meta = _check_meta(data.get("meta"))
    extra = data.get("additional_kwargs")
    if isinstance(extra, Mapping) and extra:
        _check_not_reserved(extra, "additional_kwargs")
        check_json(extra, "additional_kwargs")
        meta = {**extra, **meta}
    if data.get("status") == "error":
        meta["is_error"] = True
    return meta


def parse(obj: Any, fmt: str = "openai") -> list[Message]:
    """Messages from one decoded JSON value in the given wire format."""
    if fmt == "openai":
        return [parse_openai(obj)]
    if fmt == "anthropic":
        return parse_anthropic(obj)
    if fmt == "langchain":
        return [parse_langchain(obj)]
    raise InvalidMessage(f"unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")


def read_jsonl(lines: Iterable[bytes], fmt: str = "openai") -> list[tuple[int, Message]]:
    """Decode a JSON-lines file: (line number, message) pairs; blank lines are skipped.

    Raises :class:`InvalidMessage` located at the first bad line; nothing is returned partially.
    """
    out: list[tuple[int, Message]] = []
    for line_no, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidMessage(f"text is not valid UTF-8 (byte {exc.start})", line=line_no
                                 ) from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidMessage(f"invalid JSON: {exc.msg} (column {exc.colno})", line=line_no
                                 ) from None
        except RecursionError:
            raise InvalidMessage(TOO_DEEP, line=line_no) from None
        try:
            out.extend((line_no, m) for m in parse(obj, fmt))
        except InvalidMessage as exc:
            raise exc.at_line(line_no) from None
    return out


# --------------------------------------------------------------------------------------------
# Links between tool calls and results across a session


REUSED_OPEN = "tool call id {id!r} is reused while its earlier call has no result yet"
ORPHAN = "tool result for {id!r} matches no earlier tool call of the session"
ANSWERED = "tool call {id!r} already has a result"


class ToolLinks:
    """Which tool calls of a session are open (issued, unanswered) or closed, to check a batch.

    A result must answer an open call. An id may be issued again once its earlier call has its
    result (real transcripts do this: the pairing stays unambiguous, each result answering the
    nearest earlier call), but never while that call is still open: a provider could not tell
    which call a result answers. :meth:`check` walks a batch in order and raises at the first
    message that breaks a link.
    """

    def __init__(self, open_ids: Iterable[str] = (), closed_ids: Iterable[str] = ()) -> None:
        self.open = set(open_ids)
        self.closed = set(closed_ids) - self.open

    def check(self, messages: Iterable[Message]) -> None:
        for index, message in enumerate(messages):
            for i, call in enumerate(message.tool_calls):
                if call.id in self.open:
                    raise InvalidMessage(REUSED_OPEN.format(id=call.id), index=index,
                                         field=f"tool_calls[{i}].id")
                self.open.add(call.id)
                self.closed.discard(call.id)
            if message.role == "tool":
                call_id = message.tool_call_id or ""
                if call_id in self.open:
                    self.open.remove(call_id)
                    self.closed.add(call_id)
                elif call_id in self.closed:
                    raise InvalidMessage(ANSWERED.format(id=call_id), index=index,
                                         field="tool_call_id")
                else:
                    raise InvalidMessage(ORPHAN.format(id=call_id), index=index,
                                         field="tool_call_id")


class BatchLinks:
    """A batch's tool links, checked within the batch, with what is left for the database.

    ``calls`` are ``(id, index, result index or None)`` for each call the batch issues;
    ``external`` are ``(id, index)`` for results answering a call issued before the batch, which
    must still be open, and which only the database can tell. The database closes external
    results before it checks that the batch's calls do not reuse an open id.
    """

    def __init__(self, messages: Sequence[Message]) -> None:
        self.calls: list[tuple[str, int, int | None]] = []
        self.external: list[tuple[str, int]] = []
        open_here: dict[str, int] = {}  # id -> position in self.calls
        closed_here: set[str] = set()
        for index, message in enumerate(messages):
            for i, call in enumerate(message.tool_calls):
                if call.id in open_here:
                    raise InvalidMessage(REUSED_OPEN.format(id=call.id), index=index,
                                         field=f"tool_calls[{i}].id")
                open_here[call.id] = len(self.calls)
                self.calls.append((call.id, index, None))
            if message.role == "tool":
                call_id = message.tool_call_id or ""
                if call_id in open_here:
                    pos = open_here.pop(call_id)
                    self.calls[pos] = (call_id, self.calls[pos][1], index)
                    closed_here.add(call_id)
                elif call_id in closed_here:
                    raise InvalidMessage(ANSWERED.format(id=call_id), index=index,
                                         field="tool_call_id")
                else:
                    self.external.append((call_id, index))
                    closed_here.add(call_id)


def referenced_call_ids(messages: Iterable[Message]) -> Iterator[str]:
    """Every tool-call id a batch issues or answers (what storage must look up)."""
    for message in messages:
        for call in message.tool_calls:
            yield call.id
        if message.tool_call_id:
            yield message.tool_call_id
