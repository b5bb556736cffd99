"""Provider clients: OpenAI Chat Completions, Anthropic Messages, OpenAI-compatible endpoints.

Each call goes through the official SDK with its own retries off (``max_retries=0``): retries are
decided once, by the fallback's tenacity loop, so they never multiply (SDK 2 retries x tenacity 4
attempts would be 12 requests per candidate). Every call carries the attribution header as an HTTP
header, so the model-visible body is exactly what the caller built, and caps its output.

SDK exceptions are translated here into :class:`~worker.llm.errors.ProviderError` (``from None``:
an SDK exception's message embeds the provider's response body, which can echo the prompt, so it
is not chained into tracebacks). Text extraction follows DeepSeek Harness: only text is projected
into a summary; reasoning and tool calls are ignored next to text, and output that has no text, or
has an image or audio part, fails instead of being silently dropped.

Scope: an SDK client owns an HTTP connection pool, and connections belong to the event loop and
the process that opened them. A :class:`ProviderPool` therefore serves one event loop in one
process and refuses to be used from another. A worker process keeps one, in its one event loop
(``worker.runtime``).

Each SDK is imported when the first client of its kind is built, not with this module: importing
``anthropic`` or ``openai`` costs a large part of a process's start-up CPU, paid by every worker
start, CLI ``compact --inline`` and test process, most of which never use both. A worker imports
the SDKs its configured models need (:func:`import_sdks`) when it starts, before it consumes: an
import inside the loop would stall every compaction in flight, and calls held back by a rate meter
would then all leave at once, over the provider's quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import importlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pydantic

from storage.kinds import ModelFailure
from worker.compaction.sharing import CacheHints
from worker.llm.candidates import Availability, Candidate
from worker.llm.errors import ProviderError, Unavailable
from worker.llm.usage import Usage
from worker.settings import ModelSpec, WorkerConfig

if TYPE_CHECKING:
    import anthropic
    import openai

logger = logging.getLogger(__name__)

# One chat message in the OpenAI wire shape: role and content, and in replay mode the runtime's
# own turns with tool calls, tool results and content blocks.
ChatMessage = Mapping[str, Any]
Tool = Mapping[str, Any]

DEFAULT_ATTRIBUTION_HEADER = "x-compactd-purpose"
DEFAULT_ATTRIBUTION_VALUE = "compaction"
DEFAULT_KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
# vLLM, Ollama and llama.cpp accept any key; the SDK refuses to start without one.
NO_KEY_PLACEHOLDER = "EMPTY"

# Output blocks that are not text and are not projected into a summary, but do not make text
# next to them invalid (DSH: reasoning and tool calls never leak into a checkpoint).
_IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking", "tool_use", "server_tool_use"})
_CONTEXT_MARKERS = ("context_length_exceeded", "maximum context length", "context length",
                    "prompt is too long", "too many tokens", "input is too long",
                    "context window")
_QUOTA_CODES = frozenset({"insufficient_quota", "enforced_spend_limit_reached",
                          "contract_spend_limit_reached", "billing_hard_limit_reached"})
_SAFE_CODE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Attribution:
    """The HTTP header every summary call carries, so provider dashboards can tell compaction
    traffic from the agent's own; it is a header so the body (and the prefix cache) is unchanged."""

    header: str = DEFAULT_ATTRIBUTION_HEADER
    value: str = DEFAULT_ATTRIBUTION_VALUE

    def headers(self) -> dict[str, str]:
        return {self.header: self.value} if self.header else {}

    @classmethod
    def from_config(cls, worker: WorkerConfig) -> Attribution:
        return cls(worker.attribution_header, worker.attribution_value)


@dataclass(frozen=True, slots=True)
class Completion:
    """What one successful call returned. ``model`` is the model the provider says it used."""

    text: str
    model: str
    usage: Usage
    request_id: str | None = None
    stop_reason: str | None = None
    truncated: bool = False  # the output hit max_tokens


class Provider(Protocol):
    candidate: Candidate

    async def complete(self, chat: Sequence[ChatMessage], *, max_tokens: int,
                       tools: Sequence[Tool] = (), cache: CacheHints | None = None
                       ) -> Completion: ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------------------------
# building


_SDK_OF_PROVIDER = {"openai": "openai", "openai-compatible": "openai", "anthropic": "anthropic"}


def import_sdks(models: Iterable[ModelSpec]) -> list[str]:
    """Import the SDK of every remote provider among ``models``; the modules imported."""
    names = sorted({_SDK_OF_PROVIDER[m.provider] for m in models if m.provider in _SDK_OF_PROVIDER})
    for name in names:
        importlib.import_module(name)
    return names


class BuildError(Exception):
    """A client cannot be built from its spec (caught by the pool, never escapes it)."""


def build_provider(candidate: Candidate, *, attribution: Attribution,
                   env: Mapping[str, str]) -> Provider:
    """A provider for ``candidate``; raises :class:`BuildError` naming what is missing."""
    spec = candidate.spec
    if spec is None or candidate.is_local:
        raise BuildError(f"{candidate.name} is not a remote model")
    key_env = spec.api_key_env or DEFAULT_KEY_ENV.get(spec.provider)
    key = env.get(key_env) if key_env else None
    if key_env and not key:
        raise BuildError(f"environment variable {key_env} is not set")
    headers = attribution.headers()
    if spec.provider in ("openai", "openai-compatible"):
        if spec.provider == "openai-compatible" and not spec.base_url:
            raise BuildError("an openai-compatible model needs base_url")
        import openai
        try:
            client = openai.AsyncOpenAI(api_key=key or NO_KEY_PLACEHOLDER,
                                        base_url=spec.base_url, timeout=spec.timeout_s,
                                        max_retries=0, default_headers=headers,
                                        http_client=_aiohttp_client(openai))
        except openai.OpenAIError as exc:
            raise BuildError(f"the client cannot be built ({type(exc).__name__})") from None
        # OpenAI deprecated max_tokens for max_completion_tokens (o-series reject the old one);
        # most compatible servers (vLLM, Ollama, DeepSeek) only know max_tokens.
        token_param = "max_completion_tokens" if spec.provider == "openai" else "max_tokens"
        return OpenAIChatProvider(candidate, client, token_param=token_param,
                                  max_output_tokens=spec.max_output_tokens)
    if spec.provider == "anthropic":
        import anthropic
        try:
            aclient = anthropic.AsyncAnthropic(api_key=key, base_url=spec.base_url,
                                               timeout=spec.timeout_s, max_retries=0,
                                               default_headers=headers,
                                               http_client=_aiohttp_client(anthropic))
        except anthropic.AnthropicError as exc:
            raise BuildError(f"the client cannot be built ({type(exc).__name__})") from None
        return AnthropicProvider(candidate, aclient, max_output_tokens=spec.max_output_tokens)
    raise BuildError(f"unknown provider {spec.provider!r}")


def _aiohttp_client(sdk: Any) -> Any:
    """The SDK's own aiohttp-backed HTTP client (its ``aiohttp`` extra), or None for the SDK's
    default when this SDK version or installation has none.

    Same requests, errors and timeouts; aiohttp parses HTTP in C where the default stack
    (httpcore and h11) does it in Python, which a worker pays on every call. The client opens
    its session at the first request, inside the event loop that makes it.
    """
    factory = getattr(sdk, "DefaultAioHttpClient", None)
    if factory is None:
        return None
    try:
        return factory()
    except RuntimeError:  # the SDK was installed without its aiohttp extra
        return None


# --------------------------------------------------------------------------------------------
# OpenAI Chat Completions (and compatible servers)


class OpenAIChatProvider:
    def __init__(self, candidate: Candidate, client: openai.AsyncOpenAI, *, token_param: str,
                 max_output_tokens: int | None = None) -> None:
        self.candidate = candidate
        self._client = client
        self._token_param = token_param
        self._max_output = max_output_tokens

    async def complete(self, chat: Sequence[ChatMessage], *, max_tokens: int,
                       tools: Sequence[Tool] = (), cache: CacheHints | None = None
                       ) -> Completion:
        import openai  # imported by build_provider already: a dictionary lookup
        limit = _cap(max_tokens, self._max_output)
        kwargs: dict[str, Any] = {self._token_param: limit}
        if tools:
            kwargs["tools"] = [openai_tool(t) for t in tools]
        if cache is not None and cache.prompt_cache_key:
            # The runtime's key routes the call to the cache its requests filled.
            kwargs["prompt_cache_key"] = cache.prompt_cache_key
        with sdk_errors(openai, _openai_body):
            raw = await self._client.chat.completions.with_raw_response.create(
                model=self.candidate.model_id, messages=[dict(m) for m in chat],  # type: ignore[misc]
                **kwargs)
        request_id = raw.request_id
        try:
            parsed: Any = raw.parse()
        except (openai.APIResponseValidationError, ValueError, pydantic.ValidationError):
            raise _malformed(request_id) from None
        return openai_completion(parsed, request_id)

    async def aclose(self) -> None:
        await self._client.close()


def openai_usage(parsed: Any) -> Usage:
    """What a Chat Completions response says was billed (all None when it says nothing)."""
    usage = getattr(parsed, "usage", None)
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return Usage(input_tokens=_count(getattr(usage, "prompt_tokens", None)),
                 output_tokens=_count(getattr(usage, "completion_tokens", None)),
                 cached_tokens=_count(getattr(details, "cached_tokens", None)))


def openai_completion(parsed: Any, request_id: str | None) -> Completion:
    """Text, model and usage of a Chat Completions response; fails on non-text output.

    Every failure after the response arrived carries its usage: the answer was billed."""
    usage = openai_usage(parsed)

    def refused(kind: ModelFailure, reason: str) -> ProviderError:
        return ProviderError(kind, reason, request_id=request_id, usage=usage)

    choices = getattr(parsed, "choices", None)
    if not isinstance(parsed, pydantic.BaseModel) or not choices:
        raise refused(ModelFailure.MALFORMED, "the response has no choices")
    choice = choices[0]
    message = getattr(choice, "message", None)
    if message is None:
        raise refused(ModelFailure.MALFORMED, "the first choice has no message")
    finish = getattr(choice, "finish_reason", None)
    if getattr(message, "audio", None) is not None:
        raise refused(ModelFailure.NON_TEXT, "the output has an audio part")
    content = message.content
    if isinstance(content, list):  # lenient parse of a compatible server's content parts
        kinds = {str(part.get("type")) for part in content if isinstance(part, Mapping)}
        if kinds - {"text"}:
            raise refused(ModelFailure.NON_TEXT, f"the output has {_kinds(kinds - {'text'})} parts")
        content = "".join(str(part.get("text", "")) for part in content)
    text = content if isinstance(content, str) else ""
    if getattr(message, "refusal", None) and not text.strip():
        raise refused(ModelFailure.REFUSED, "the model refused")
    if finish == "content_filter":
        raise refused(ModelFailure.REFUSED, "the content filter stopped the output")
    if not text.strip():
        extra = getattr(message, "model_extra", None) or {}
        if getattr(message, "tool_calls", None) or getattr(message, "function_call", None):
            raise refused(ModelFailure.NON_TEXT, "the output is tool calls only")
        if extra.get("reasoning_content") or extra.get("reasoning"):
            raise refused(ModelFailure.NON_TEXT, "the output is reasoning only")
    return Completion(text=text, model=str(getattr(parsed, "model", "") or ""), usage=usage,
                      request_id=request_id, stop_reason=finish, truncated=finish == "length")


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _openai_body(body: object) -> Mapping[str, Any]:
    # The openai SDK already unwrapped {"error": {...}}.
    return body if isinstance(body, Mapping) else {}


def _anthropic_body(body: object) -> Mapping[str, Any]:
    body = body if isinstance(body, Mapping) else {}
    error = body.get("error")
    return error if isinstance(error, Mapping) else body


@contextlib.contextmanager
def sdk_errors(sdk: Any, error_body: Callable[[object], Mapping[str, Any]]) -> Iterator[None]:
    """One SDK's request errors as ``ProviderError``s. Both SDKs name their exceptions alike;
    ``from None`` because their messages embed the response body, which is never logged."""
    try:
        yield
    except sdk.APIStatusError as exc:
        raise status_error(exc.status_code, exc.response.headers, error_body(exc.body),
                           request_id=exc.request_id) from None
    except sdk.APITimeoutError as exc:  # a subclass of APIConnectionError: first
        if _refused(exc):
            raise ProviderError(ModelFailure.CONNECTION, "cannot connect to the provider") from None
        raise ProviderError(ModelFailure.TIMEOUT, "the request timed out") from None
    except sdk.APIConnectionError:
        raise ProviderError(ModelFailure.CONNECTION, "cannot connect to the provider") from None
    except (ValueError, TypeError) as exc:
        raise _refused_by_sdk(exc) from None


def _refused(exc: BaseException) -> bool:
    """Whether a timeout error the SDK raised is a connection that failed without timing out.

    The aiohttp transport reports every aiohttp connection error as a connect timeout: a
    refused connection (its cause an OSError that is no TimeoutError) and a server that closed
    the connection (an aiohttp ``ClientConnectionError`` that is no ``ServerTimeoutError``)
    alike. Only the timeouts themselves are TimeoutErrors there."""
    try:  # a failing request only; the SDK's own transport serves when aiohttp is missing
        from aiohttp import ClientConnectionError
        dropped: tuple[type[BaseException], ...] = (OSError, ClientConnectionError)
    except ImportError:
        dropped = (OSError,)
    seen: BaseException | None = exc.__cause__ or exc.__context__
    for _ in range(6):
        if seen is None:
            return False
        if isinstance(seen, dropped) and not isinstance(seen, TimeoutError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# --------------------------------------------------------------------------------------------
# Anthropic Messages


class AnthropicProvider:
    def __init__(self, candidate: Candidate, client: anthropic.AsyncAnthropic, *,
                 max_output_tokens: int | None = None) -> None:
        self.candidate = candidate
        self._client = client
        self._max_output = max_output_tokens

    async def complete(self, chat: Sequence[ChatMessage], *, max_tokens: int,
                       tools: Sequence[Tool] = (), cache: CacheHints | None = None
                       ) -> Completion:
        import anthropic  # imported by build_provider already: a dictionary lookup
        system, messages = anthropic_messages(chat)
        kwargs: dict[str, Any] = {"system": system} if system else {}
        if cache is not None and cache.cache_control:
            blocks, messages = with_breakpoints(system, messages, cache.cache_control)
            if blocks:
                kwargs["system"] = blocks
        if tools:
            kwargs["tools"] = [anthropic_tool(t) for t in tools]
        with sdk_errors(anthropic, _anthropic_body):
            raw = await self._client.messages.with_raw_response.create(
                model=self.candidate.model_id, messages=messages,  # type: ignore[arg-type]
                max_tokens=_cap(max_tokens, self._max_output), **kwargs)
        request_id = raw.request_id
        try:
            parsed: Any = await raw.parse()
        except (anthropic.APIResponseValidationError, ValueError, pydantic.ValidationError):
            raise _malformed(request_id) from None
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
            result: dict[str, Any] = {"type": "tool_result",
                                      "tool_use_id": message.get("tool_call_id")}
            if content:
                result["content"] = (content if isinstance(content, str)
                                     else _anthropic_blocks(content))
            last = out[-1] if out else None
            if (last is not None and last["role"] == "user" and isinstance(last["content"], list)
                    and all(b.get("type") == "tool_result" for b in last["content"])):
                last["content"].append(result)
            else:
                out.append({"role": "user", "content": [result]})
            continue
        role = "assistant" if role == "assistant" else "user"
        calls = message.get("tool_calls") or ()
        if isinstance(content, str) and not calls:
            if content:
                out.append({"role": role, "content": content})
            continue
        blocks = _anthropic_blocks(content) + [_tool_use(c) for c in calls]
        if blocks:
            out.append({"role": role, "content": blocks})
    return "\n\n".join(system), out


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


def openai_tool(tool: Tool) -> dict[str, Any]:
    """A tool schema in Chat Completions' shape (an Anthropic one is converted)."""
    if "input_schema" in tool and "function" not in tool:
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        return {"type": "function", "function": function}
    return dict(tool)


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
    fresh = _count(getattr(usage, "input_tokens", None))
    read = _count(getattr(usage, "cache_read_input_tokens", None))
    written = _count(getattr(usage, "cache_creation_input_tokens", None))
    total_in = None if fresh is None else fresh + (read or 0) + (written or 0)
    return Usage(input_tokens=total_in, output_tokens=_count(getattr(usage, "output_tokens", None)),
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
        raise refused(ModelFailure.NON_TEXT, f"the output is {_kinds(ignored)} only")
    return Completion(text=text, model=str(getattr(parsed, "model", "") or ""), usage=usage,
                      request_id=request_id, stop_reason=stop, truncated=stop == "max_tokens")


# --------------------------------------------------------------------------------------------
# errors


def status_error(status: int, headers: Mapping[str, str], error: Mapping[str, Any], *,
                 request_id: str | None) -> ProviderError:
    """The :class:`ProviderError` for an HTTP error response.

    ``error`` is the provider's error object (``{"type", "code", "message"}``). Its message is
    read to recognise a context-length error but never copied into the reason: only status, type
    and code, which are identifiers, are.
    """
    etype = _safe(error.get("type"))
    code = _safe(error.get("code")) or _safe(_get(error, "details", "error_code"))
    message = str(error.get("message") or "").lower()
    label = "/".join(p for p in (etype, code) if p)
    reason = f"HTTP {status}" + (f" {label}" if label else "")
    should_retry = (headers.get("x-should-retry") or "").lower()
    transient = True if should_retry == "true" else False if should_retry == "false" else None
    kind: ModelFailure
    retry_after = None
    if status in (400, 413) and (code == "context_length_exceeded"
                                 or any(m in message for m in _CONTEXT_MARKERS)):
        kind = ModelFailure.CONTEXT_LENGTH
        if code != "context_length_exceeded":
            reason += " (prompt is too long)"
    elif status in (401, 403):
        kind = ModelFailure.AUTH
    elif status == 404:
        kind = ModelFailure.NOT_FOUND
    elif status == 408:
        kind = ModelFailure.TIMEOUT
    elif status == 429 and (code in _QUOTA_CODES or etype in _QUOTA_CODES):
        kind = ModelFailure.QUOTA
    elif status == 429:
        kind = ModelFailure.RATE_LIMITED
        retry_after = retry_after_s(headers)
    elif status == 409 or status >= 500:
        kind = ModelFailure.SERVER
        retry_after = retry_after_s(headers)
    else:
        kind = ModelFailure.BAD_REQUEST
    if kind == ModelFailure.CONTEXT_LENGTH:
        transient = False
    return ProviderError(kind, reason, status=status, retry_after_s=retry_after,
                         request_id=request_id, transient=transient)


def retry_after_s(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds the provider asks to wait: ``retry-after-ms``, ``retry-after`` (seconds or an
    HTTP date). None when absent or unreadable."""
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / divisor
        except ValueError:
            if divisor != 1.0:
                continue
            try:
                parsed = email.utils.parsedate_to_datetime(value)
            except (ValueError, TypeError):
                continue
            if parsed.tzinfo is None:
                continue
            seconds = parsed.timestamp() - (time.time() if now is None else now)
        if seconds == seconds and seconds >= 0:  # not NaN
            return seconds
        return 0.0
    return None


def _refused_by_sdk(exc: Exception) -> ProviderError:
    # Raised before anything is sent (an argument the SDK rejects): the request itself is
    # wrong, so it is not retried, and it is not the provider's malformed answer either.
    return ProviderError(ModelFailure.BAD_REQUEST, f"the SDK refused to send the request "
                                        f"({type(exc).__name__})")


def _malformed(request_id: str | None) -> ProviderError:
    return ProviderError(ModelFailure.MALFORMED, "the response body is not valid JSON",
                         request_id=request_id)


def _safe(value: Any) -> str | None:
    return value if isinstance(value, str) and _SAFE_CODE.match(value) else None


def _get(mapping: Mapping[str, Any], *keys: str) -> Any:
    value: Any = mapping
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _cap(requested: int, limit: int | None) -> int:
    return min(requested, limit) if limit else requested


def _kinds(kinds: set[str]) -> str:
    return "/".join(sorted(kinds))


# --------------------------------------------------------------------------------------------
# scope: one pool per event loop and process


class ProviderPool:
    """Built providers for one event loop, by candidate name.

    Building is lazy and guarded: a candidate whose client cannot be built is marked in
    ``availability`` (one WARNING per unavailability window) and raises :class:`Unavailable`;
    while it stays marked it raises at once without trying again. Call :meth:`aclose` before the
    loop ends; the pool is unusable on any other loop or in a forked child.
    """

    def __init__(self, *, attribution: Attribution | None = None,
                 availability: Availability | None = None,
                 env: Mapping[str, str] | None = None,
                 build: Callable[..., Provider] = build_provider) -> None:
        self.attribution = attribution or Attribution()
        self.availability = availability or Availability()
        self._env = env
        self._build = build
        self._providers: dict[str, Provider] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = os.getpid()
        self._closed = False

    @classmethod
    def from_config(cls, worker: WorkerConfig, *, env: Mapping[str, str] | None = None,
                    clock: Callable[[], float] = time.monotonic) -> ProviderPool:
        """The pool a worker process keeps: its attribution header, its unavailability
        window."""
        return cls(attribution=Attribution.from_config(worker),
                   availability=Availability(worker.unavailable_model_s, clock=clock), env=env)

    def get(self, candidate: Candidate) -> Provider:
        self._check_scope()
        reason = self.availability.reason(candidate.name)
        if reason is not None:
            logger.debug("model %s is remembered as unavailable", candidate.name,
                         extra={"action": "llm.unavailable", "candidate": candidate.name})
            raise Unavailable(reason)
        provider = self._providers.get(candidate.name)
        if provider is not None:
            return provider
        try:
            provider = self._build(candidate, attribution=self.attribution,
                                   env=os.environ if self._env is None else self._env)
        except (BuildError, ValueError) as exc:
            reason = exc.args[0] if isinstance(exc, BuildError) else (
                f"the client cannot be built ({type(exc).__name__})")
            self.mark_broken(candidate, reason)
            raise Unavailable(reason) from None
        self._providers[candidate.name] = provider
        return provider

    def mark_broken(self, candidate: Candidate, reason: str) -> None:
        """Remember ``candidate`` as unavailable; warn the first time in its window."""
        if self.availability.mark(candidate.name, reason):
            logger.warning("model %s is unavailable for %.0f s: %s", candidate.name,
                           self.availability.ttl_s, reason,
                           extra={"action": "llm.unavailable", "candidate": candidate.name,
                                  "reason": reason})

    async def aclose(self) -> None:
        self._closed = True
        providers, self._providers = list(self._providers.values()), {}
        if os.getpid() != self._pid:
            return  # the sockets belong to the parent process
        for provider in providers:
            await provider.aclose()

    def _check_scope(self) -> None:
        if self._closed:
            raise RuntimeError("this ProviderPool is closed")
        if os.getpid() != self._pid:
            raise RuntimeError("a ProviderPool cannot be used in a forked child; build a new one")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("a ProviderPool serves one event loop; build one per loop")
