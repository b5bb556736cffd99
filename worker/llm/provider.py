"""What a provider is, whichever API it speaks: the :class:`Provider` protocol, the
:class:`Completion` it returns, the :class:`Attribution` header it sends, and the helpers every
provider module shares.

Each call goes through the official SDK with its own retries off (``max_retries=0``): retries are
decided once, by the fallback's tenacity loop, so they never multiply (SDK 2 retries x tenacity 4
attempts would be 12 requests per candidate). Every call carries the attribution header as an HTTP
header, so the model-visible body is exactly what the caller built, and caps its output.

Each provider module translates its own SDK's exceptions into
:class:`~worker.llm.errors.ProviderError` (``from None``: an SDK exception's message embeds the
provider's response body, which can echo the prompt, so it is not chained into tracebacks), with
:mod:`worker.llm.http_errors`. Text extraction follows DeepSeek Harness: only text is projected
into a summary; reasoning and tool calls are ignored next to text, and output that has no text, or
has an image or audio part, fails instead of being silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from compactd.worker.compaction.sharing import CacheHints
from compactd.worker.llm.candidates import Candidate
from compactd.worker.llm.usage import Usage
from compactd.worker.settings import WorkerConfig

# One chat message in the OpenAI wire shape: role and content, and in replay mode the runtime's
# own turns with tool calls, tool results and content blocks.
ChatMessage = Mapping[str, Any]
Tool = Mapping[str, Any]

DEFAULT_ATTRIBUTION_HEADER = "x-compactd-purpose"
DEFAULT_ATTRIBUTION_VALUE = "compaction"


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




class BuildError(Exception):
    """A client cannot be built from its spec (caught by the pool, never escapes it)."""


def aiohttp_client(sdk: Any) -> Any:
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


def count(value: Any) -> int | None:
    """A token count a response reports, or None when it is not an integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def cap(requested: int, limit: int | None) -> int:
    return min(requested, limit) if limit else requested


def kinds_text(kinds: set[str]) -> str:
    return "/".join(sorted(kinds))
