"""What can go wrong when a summary is asked of a model, as data the orchestration can record.

Every SDK exception is translated into a :class:`ProviderError` at the provider boundary
(``worker.llm.providers``), so the fallback and everything above it never catch an ``openai`` or
``anthropic`` exception. A failure has a *kind* (one word, stable, safe to store and count) and a
*reason* (a short sentence built by compactd from status codes and error codes, never the
provider's response body, which can echo the prompt). When every candidate fails, the fallback
raises its own :class:`worker.llm.fallback.SummaryFailed`, which carries the attempts.
"""

from __future__ import annotations

from typing import Literal

from storage.errors import CompactdError

ErrorKind = Literal[
    "auth",            # 401/403: the key is wrong, expired or lacks the scope
    "not_found",       # 404: the model or endpoint does not exist
    "bad_request",     # any other 4xx: the request itself is wrong; repeating it cannot help
    "quota",           # 429 that says the spend limit or quota is used up: not transient
    "rate_limited",    # 429: transient, honour Retry-After
    "server",          # 5xx, 529 overloaded, 409: transient
    "timeout",         # the request or the candidate's time budget ran out: transient per request
    "connection",      # connect/read failure below HTTP: transient
    "context_length",  # the input is larger than the model's window
    "malformed",       # a 2xx whose body is not the wire format (bad JSON, wrong shape)
    "non_text",        # no text: tool calls only, reasoning only, or an image/audio part
    "empty",           # text that is empty or whitespace only
    "truncated",       # the output stopped at its token cap (a summary cut off mid-section)
    "refused",         # the policy's validation refused the text (e.g. it does not shrink)
    "unavailable",     # the client cannot be built (missing key, bad spec) or is remembered so
    "deadline",        # the overall deadline ended this candidate or came before it started
    "internal",        # an unexpected exception in compactd's adapter code
]

# Kinds worth another HTTP attempt on the same candidate.
TRANSIENT_KINDS: frozenset[str] = frozenset({"rate_limited", "server", "timeout", "connection"})
# Kinds that say the candidate itself is broken, so it is remembered as unavailable for a while
# instead of costing one failed call per compaction.
BROKEN_KINDS: frozenset[str] = frozenset({"auth", "not_found", "quota", "unavailable"})


class LLMError(CompactdError):
    """A summarizer model failed."""


class ProviderError(LLMError):
    """The provider call failed."""

    def __init__(self, kind: ErrorKind, reason: str, *, status: int | None = None,
                 retry_after_s: float | None = None, request_id: str | None = None,
                 transient: bool | None = None) -> None:
        self.kind: ErrorKind = kind
        self.reason = reason
        self.status = status
        self.retry_after_s = retry_after_s
        self.request_id = request_id
        # A provider can say explicitly whether a retry helps (``x-should-retry``); else the kind
        # decides.
        self.transient = kind in TRANSIENT_KINDS if transient is None else transient
        super().__init__(f"{kind}: {reason}")


class Unavailable(LLMError):
    """The model cannot be used: its client cannot be built."""


class LocalSummaryError(LLMError):
    """The local summarizer cannot write a summary that is shorter than its input."""

