"""OpenAI Chat Completions, and servers that speak it (vLLM, Ollama, llama.cpp, DeepSeek): the
provider, its request and response shapes, and the translation of the ``openai`` SDK's
exceptions.

The ``openai`` SDK is imported when the first client is built (:func:`build`), not with this
module: see :mod:`worker.llm.providers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    import openai

# vLLM, Ollama and llama.cpp accept any key; the SDK refuses to start without one.
NO_KEY_PLACEHOLDER = "EMPTY"


def build(candidate: Candidate, key: str | None, attribution: Attribution) -> OpenAIChatProvider:
    """A client for an ``openai`` or ``openai-compatible`` model."""
    spec = candidate.spec
    assert spec is not None
    if spec.provider == "openai-compatible" and not spec.base_url:
        raise BuildError("an openai-compatible model needs base_url")
    import openai
    try:
        client = openai.AsyncOpenAI(api_key=key or NO_KEY_PLACEHOLDER,
                                    base_url=spec.base_url, timeout=spec.timeout_s,
                                    max_retries=0, default_headers=attribution.headers(),
                                    http_client=aiohttp_client(openai))
    except openai.OpenAIError as exc:
        raise BuildError(f"the client cannot be built ({type(exc).__name__})") from None
    # OpenAI deprecated max_tokens for max_completion_tokens (o-series reject the old one);
    # most compatible servers (vLLM, Ollama, DeepSeek) only know max_tokens.
    token_param = "max_completion_tokens" if spec.provider == "openai" else "max_tokens"
    return OpenAIChatProvider(candidate, client, token_param=token_param,
                              max_output_tokens=spec.max_output_tokens)


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
        import openai  # imported by build already: a dictionary lookup
        limit = cap(max_tokens, self._max_output)
        kwargs: dict[str, Any] = {self._token_param: limit}
        # The messages and tools go in extra_body, whose keys replace the body's: create() would
        # walk every message, content part and schema through the SDK's type-driven transform,
        # which for a call carrying the runtime's whole request (share_cache) took longer than
        # the model's answer, and grows faster than the request (docs/benchmarks.md, "Prefix
        # cache cost"). They are plain JSON already, which that transform leaves as it is.
        body: dict[str, Any] = {"messages": [dict(m) for m in chat]}
        if tools:
            body["tools"] = [openai_tool(t) for t in tools]
        if cache is not None and cache.prompt_cache_key:
            # The runtime's key routes the call to the cache its requests filled.
            kwargs["prompt_cache_key"] = cache.prompt_cache_key
        with openai_errors():
            raw = await self._client.chat.completions.with_raw_response.create(
                model=self.candidate.model_id, messages=[], extra_body=body, **kwargs)
        request_id = raw.request_id
        try:
            parsed: Any = raw.parse()
        except (openai.APIResponseValidationError, ValueError, pydantic.ValidationError):
            raise malformed(request_id) from None
        return openai_completion(parsed, request_id)

    async def aclose(self) -> None:
        await self._client.close()


def openai_usage(parsed: Any) -> Usage:
    """What a Chat Completions response says was billed (all None when it says nothing)."""
    usage = getattr(parsed, "usage", None)
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return Usage(input_tokens=count(getattr(usage, "prompt_tokens", None)),
                 output_tokens=count(getattr(usage, "completion_tokens", None)),
                 cached_tokens=count(getattr(details, "cached_tokens", None)))


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
    text = _message_text(message, refused)
    failure = _no_summary(message, text, finish)
    if failure is not None:
        raise refused(*failure)
    return Completion(text=text, model=str(getattr(parsed, "model", "") or ""), usage=usage,
                      request_id=request_id, stop_reason=finish, truncated=finish == "length")


def _message_text(message: Any, refused: Callable[[ModelFailure, str], ProviderError]) -> str:
    """The text of a response message; refused when it has a part that is not text."""
    if getattr(message, "audio", None) is not None:
        raise refused(ModelFailure.NON_TEXT, "the output has an audio part")
    content = message.content
    if isinstance(content, list):  # lenient parse of a compatible server's content parts
        kinds = {str(part.get("type")) for part in content if isinstance(part, Mapping)}
        if kinds - {"text"}:
            raise refused(ModelFailure.NON_TEXT,
                          f"the output has {kinds_text(kinds - {'text'})} parts")
        content = "".join(str(part.get("text", "")) for part in content)
    return content if isinstance(content, str) else ""


def _no_summary(message: Any, text: str, finish: str | None) -> tuple[ModelFailure, str] | None:
    """Why a message with this text is no summary (a refusal, tool calls or reasoning only),
    or None."""
    if getattr(message, "refusal", None) and not text.strip():
        return ModelFailure.REFUSED, "the model refused"
    if finish == "content_filter":
        return ModelFailure.REFUSED, "the content filter stopped the output"
    if not text.strip():
        extra = getattr(message, "model_extra", None) or {}
        if getattr(message, "tool_calls", None) or getattr(message, "function_call", None):
            return ModelFailure.NON_TEXT, "the output is tool calls only"
        if extra.get("reasoning_content") or extra.get("reasoning"):
            return ModelFailure.NON_TEXT, "the output is reasoning only"
    return None


def openai_tool(tool: Tool) -> dict[str, Any]:
    """A tool schema in Chat Completions' shape (an Anthropic one is converted)."""
    if "input_schema" in tool and "function" not in tool:
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        return {"type": "function", "function": function}
    return dict(tool)



@contextlib.contextmanager
def openai_errors() -> Iterator[None]:
    """The ``openai`` SDK's request errors as ``ProviderError``s; ``from None`` because their
    messages embed the response body, which is never logged."""
    import openai  # imported by build already: a dictionary lookup
    try:
        yield
    except openai.APIStatusError as exc:
        # The SDK already unwrapped {"error": {...}}.
        body = exc.body if isinstance(exc.body, Mapping) else {}
        raise status_error(exc.status_code, exc.response.headers, body,
                           request_id=exc.request_id) from None
    except openai.APITimeoutError as exc:  # a subclass of APIConnectionError: first
        raise timed_out(exc) from None
    except openai.APIConnectionError:
        raise connection_failed() from None
    except (ValueError, TypeError) as exc:
        raise refused_by_sdk(exc) from None
