"""Anthropic Messages: the provider, the conversion of OpenAI wire turns and tools to its
shapes, its cache breakpoints, and the translation of the ``anthropic`` SDK's exceptions.

The ``anthropic`` SDK is imported when the first client is built (:func:`build`), not with this
module: see :mod:`worker.llm.providers`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pydantic

from compactd.storage.kinds import ModelFailure
from compactd.worker.compaction.sharing import CacheHints
from compactd.worker.llm.candidates import Candidate
from compactd.worker.llm.errors import ProviderError
from compactd.worker.llm.http_errors import (
    connection_failed,
    malformed,
    refused_by_sdk,
    status_error,
    timed_out,
)
from compactd.worker.llm.provider import (
    Attribution,
    BuildError,
    ChatMessage,
    Completion,
    Tool,
    aiohttp_client,
    cap,
    count,
    kinds_text,
)
from compactd.worker.llm.usage import Usage

if TYPE_CHECKING:
    import anthropic

# Output blocks that are not text and are not projected into a summary, but do not make text
# next to them invalid (DSH: reasoning and tool calls never leak into a checkpoint).
_IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking", "tool_use", "server_tool_use"})


def build(candidate: Candidate, key: str | None, attribution: Attribution) -> AnthropicProvider:
    """A client for an ``anthropic`` model."""
    spec = candidate.spec
    assert spec is not None
    import anthropic
    try:
        client = anthropic.AsyncAnthropic(api_key=key, base_url=spec.base_url,
                                          timeout=spec.timeout_s, max_retries=0,
                                          default_headers=attribution.headers(),
                                          http_client=aiohttp_client(anthropic))
    except anthropic.AnthropicError as exc:
        raise BuildError(f"the client cannot be built ({type(exc).__name__})") from None
    return AnthropicProvider(candidate, client, max_output_tokens=spec.max_output_tokens)


class AnthropicProvider:
    def __init__(self, candidate: Candidate, client: anthropic.AsyncAnthropic, *,
                 max_output_tokens: int | None = None) -> None:
        self.candidate = candidate
        self._client = client
        self._max_output = max_output_tokens

    async def complete(self, chat: Sequence[ChatMessage], *, max_tokens: int,
                       tools: Sequence[Tool] = (), cache: CacheHints | None = None
                       ) -> Completion:
        import anthropic  # imported by build already: a dictionary lookup
        system, messages = anthropic_messages(chat)
        kwargs: dict[str, Any] = {"system": system} if system else {}
        if cache is not None and cache.cache_control:
            blocks, messages = with_breakpoints(system, messages, cache.cache_control)
            if blocks:
                kwargs["system"] = blocks
        if tools:
            kwargs["tools"] = [anthropic_tool(t) for t in tools]
        with anthropic_errors():
            raw = await self._client.messages.with_raw_response.create(
                model=self.candidate.model_id, messages=messages,  # type: ignore[arg-type]
                max_tokens=cap(max_tokens, self._max_output), **kwargs)
        request_id = raw.request_id
        try:
            parsed: Any = await raw.parse()
        except (anthropic.APIResponseValidationError, ValueError, pydantic.ValidationError):
            raise malformed(request_id) from None
        return anthropic_completion(parsed, request_id)

    async def aclose(self) -> None:
        await self._client.close()


def anthropic_messages(chat: Sequence[ChatMessage]) -> tuple[str, list[dict[str, Any]]]:
    """OpenAI wire turns in the Messages API's shape, the system text apart.

    A turn is converted on its own, so a replayed range stays a prefix of what the runtime sends
    (the API joins consecutive same-role turns itself): an assistant's tool calls become
    ``tool_use`` blocks after its text, consecutive tool results one user turn of
    ``tool_result`` blocks (how a runtime on this API sends parallel results), ``image_url``
    parts ``image`` blocks; blocks already in this API's shape pass as they are. A turn with
    nothing in it is left out: the API refuses empty content.
    """
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for message in chat:
        role, content = message["role"], message.get("content")
        if role == "system":
            system.append(content if isinstance(content, str) else "".join(
                str(b.get("text", "")) for b in _anthropic_blocks(content)))
            continue
        if role == "tool":
            _add_tool_result(out, message, content)
            continue
        turn = _turn("assistant" if role == "assistant" else "user", message, content)
        if turn is not None:
            out.append(turn)
    return "\n\n".join(system), out


def _add_tool_result(out: list[dict[str, Any]], message: ChatMessage, content: Any) -> None:
    """A tool result joins the user turn of results before it, or opens one."""
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.get("tool_call_id")}
    if content:
        result["content"] = content if isinstance(content, str) else _anthropic_blocks(content)
    last = out[-1] if out else None
    if (last is not None and last["role"] == "user" and isinstance(last["content"], list)
            and all(b.get("type") == "tool_result" for b in last["content"])):
        last["content"].append(result)
    else:
        out.append({"role": "user", "content": [result]})


def _turn(role: str, message: ChatMessage, content: Any) -> dict[str, Any] | None:
    """A user or assistant turn, its tool calls ``tool_use`` blocks after its text; None when
    it has nothing in it."""
    calls = message.get("tool_calls") or ()
    if isinstance(content, str) and not calls:
        return {"role": role, "content": content} if content else None
    blocks = _anthropic_blocks(content) + [_tool_use(c) for c in calls]
    return {"role": role, "content": blocks} if blocks else None


def with_breakpoints(system: str, messages: list[dict[str, Any]], control: dict[str, Any]
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A shared call's system and messages with the runtime's breakpoints: where an Anthropic
    runtime puts them, on its system prompt (one text block) and on the last block of its
    request's last message, which in a shared call is the message before the instruction. The
    call then reads the entry the runtime's last request wrote; the instruction after it sets
    none (nothing reads a summary call's prompt again)."""
    blocks = [{"type": "text", "text": system, "cache_control": dict(control)}] if system else []
    out = list(messages)
    if len(out) >= 2:
        last = out[-2]
        content = last["content"]
        parts: list[dict[str, Any]] = ([{"type": "text", "text": content}]
                                       if isinstance(content, str)
                                       else [dict(b) for b in content])
        if parts:
            parts[-1] = {**parts[-1], "cache_control": dict(control)}
            out[-2] = {**last, "content": parts}
    return blocks, out


def _anthropic_blocks(content: object) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out: list[dict[str, Any]] = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, Mapping):
            continue
        image = block.get("image_url")
        if block.get("type") == "image_url" and isinstance(image, Mapping | str):
            url = str(image.get("url", "") if isinstance(image, Mapping) else image)
            out.append({"type": "image", "source": _image_source(url)})
        elif block.get("type") == "text":
            if block.get("text"):
                out.append({"type": "text", "text": str(block["text"])})
        else:
            out.append(dict(block))
    return out


def _image_source(url: str) -> dict[str, str]:
    header, sep, data = url.partition(",")
    if url.startswith("data:") and sep and header.endswith(";base64"):
        return {"type": "base64", "media_type": header[5:-7], "data": data}
    return {"type": "url", "url": url}


def _tool_use(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    raw = function.get("arguments") or "{}"
    try:
        arguments = json.loads(raw)
    except ValueError:
        arguments = None
    return {"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
            "input": arguments if isinstance(arguments, dict) else {"arguments": raw}}


def anthropic_tool(tool: Tool) -> dict[str, Any]:
    """A tool schema in the Messages API's shape (a Chat Completions one is converted)."""
    function = tool.get("function")
    if tool.get("type") == "function" and isinstance(function, Mapping):
        out: dict[str, Any] = {"name": function.get("name")}
        if function.get("description"):
            out["description"] = function["description"]
        out["input_schema"] = function.get("parameters") or {"type": "object",
                                                             "properties": {}}
        return out
    return dict(tool)


def anthropic_usage(parsed: Any) -> Usage:
    """What a Messages response says was billed; input counts the cached tokens too."""
    usage = getattr(parsed, "usage", None)
    fresh = count(getattr(usage, "input_tokens", None))
    read = count(getattr(usage, "cache_read_input_tokens", None))
    written = count(getattr(usage, "cache_creation_input_tokens", None))
    total_in = None if fresh is None else fresh + (read or 0) + (written or 0)
    return Usage(input_tokens=total_in, output_tokens=count(getattr(usage, "output_tokens", None)),
                 cached_tokens=read, cache_write_tokens=written)


def anthropic_completion(parsed: Any, request_id: str | None) -> Completion:
    """Text, model and usage of a Messages response; fails on non-text output, each failure
    with the usage the answer was billed."""
    usage = anthropic_usage(parsed)

    def refused(kind: ModelFailure, reason: str) -> ProviderError:
        return ProviderError(kind, reason, request_id=request_id, usage=usage)

    blocks = getattr(parsed, "content", None)
    if not isinstance(parsed, pydantic.BaseModel) or not isinstance(blocks, list):
        raise refused(ModelFailure.MALFORMED, "the response has no content")
    texts: list[str] = []
    ignored: set[str] = set()
    for block in blocks:
        kind = str(getattr(block, "type", None) or (block.get("type") if isinstance(block, dict)
                                                    else "unknown"))
        if kind == "text":
            texts.append(str(getattr(block, "text", "") or ""))
        elif kind in _IGNORED_BLOCKS:
            ignored.add(kind)
        else:
            raise refused(ModelFailure.NON_TEXT, f"the output has a {kind!r} block")
    stop = getattr(parsed, "stop_reason", None)
    text = "".join(texts)
    if stop == "refusal":
        raise refused(ModelFailure.REFUSED, "the model refused")
    if not text.strip() and ignored:
        raise refused(ModelFailure.NON_TEXT, f"the output is {kinds_text(ignored)} only")
    return Completion(text=text, model=str(getattr(parsed, "model", "") or ""), usage=usage,
                      request_id=request_id, stop_reason=stop, truncated=stop == "max_tokens")




@contextlib.contextmanager
def anthropic_errors() -> Iterator[None]:
    """The ``anthropic`` SDK's request errors as ``ProviderError``s; ``from None`` because their
    messages embed the response body, which is never logged."""
    import anthropic  # imported by build already: a dictionary lookup
    try:
        yield
    except anthropic.APIStatusError as exc:
        raise status_error(exc.status_code, exc.response.headers, _error_object(exc.body),
                           request_id=exc.request_id) from None
    except anthropic.APITimeoutError as exc:  # a subclass of APIConnectionError: first
        raise timed_out(exc) from None
    except anthropic.APIConnectionError:
        raise connection_failed() from None
    except (ValueError, TypeError) as exc:
        raise refused_by_sdk(exc) from None


def _error_object(body: object) -> Mapping[str, Any]:
    # The SDK leaves the body whole: {"type": "error", "error": {...}}.
    body = body if isinstance(body, Mapping) else {}
    error = body.get("error")
    return error if isinstance(error, Mapping) else body
