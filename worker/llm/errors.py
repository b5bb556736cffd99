"""What can go wrong when a summary is asked of a model, as data the orchestration can record.

Every SDK exception is translated into a :class:`ProviderError` at the provider boundary (each
provider module its own SDK's, with ``worker.llm.http_errors``), so the fallback and everything
above it never catch an ``openai`` or ``anthropic`` exception. A failure has a *kind* (a
:class:`storage.kinds.ModelFailure`: one word, stable, safe to store and count) and a *reason*
(a short sentence built by compactd from status codes and error codes, never the provider's
response body, which can echo the prompt). When every candidate fails, the fallback raises its
own :class:`worker.llm.fallback.SummaryFailed`, which carries the attempts.
"""

from __future__ import annotations

from compactd.storage.errors import CompactdError
from compactd.storage.kinds import ModelFailure
from compactd.worker.llm.usage import Usage

# Kinds worth another HTTP attempt on the same candidate.
TRANSIENT_KINDS = frozenset({ModelFailure.RATE_LIMITED, ModelFailure.SERVER, ModelFailure.TIMEOUT,
                             ModelFailure.CONNECTION})
# Kinds that say the candidate itself is broken, so it is remembered as unavailable for a while
# instead of costing one failed call per compaction.
BROKEN_KINDS = frozenset({ModelFailure.AUTH, ModelFailure.NOT_FOUND, ModelFailure.QUOTA,
                          ModelFailure.UNAVAILABLE})

# Kinds that count toward a candidate's circuit (worker.llm.breaker): the endpoint did not
# answer, or answered that it cannot serve. An answer of any other kind (refused by validation,
# cut at the cap, a request too long) shows the provider is up, and resets the count.
CIRCUIT_KINDS = frozenset({ModelFailure.TIMEOUT, ModelFailure.DEADLINE, ModelFailure.CONNECTION,
                           ModelFailure.SERVER, ModelFailure.MALFORMED, ModelFailure.AUTH,
                           ModelFailure.NOT_FOUND, ModelFailure.QUOTA})


class LLMError(CompactdError):
    """A summarizer model failed."""


class ProviderError(LLMError):
    """The provider call failed."""

    def __init__(self, kind: ModelFailure, reason: str, *, status: int | None = None,
                 retry_after_s: float | None = None, request_id: str | None = None,
                 transient: bool | None = None, usage: Usage | None = None) -> None:
        self.kind: ModelFailure = kind
        self.reason = reason
        self.status = status
        self.retry_after_s = retry_after_s
        self.request_id = request_id
        # A provider can say explicitly whether a retry helps (``x-should-retry``); else the kind
        # decides.
        self.transient = kind in TRANSIENT_KINDS if transient is None else transient
        # What the provider billed for an answer refused while it was read (a refusal, tool
        # calls only...): the call was paid for even though it gave no summary.
        self.usage = usage
        super().__init__(f"{kind}: {reason}")


class Unavailable(LLMError):
    """The model cannot be used: its client cannot be built."""


class LocalSummaryError(LLMError):
    """The local summarizer cannot write a summary that is shorter than its input."""

