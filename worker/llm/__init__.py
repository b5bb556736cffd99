"""Summarizer models: candidates in order, provider clients, the local summarizer, the fallback.

The orchestration uses :func:`candidate_order` to list who may summarize a session,
:class:`ProviderPool` (one per event loop: the worker process's) for clients, and :func:`summarize`
to get the first summary the policy accepts.
"""

from compactd.storage.kinds import ModelFailure
from compactd.worker.llm.candidates import Availability, Candidate, candidate_order
from compactd.worker.llm.errors import (
    LLMError,
    LocalSummaryError,
    ProviderError,
    Unavailable,
)
from compactd.worker.llm.fallback import (
    Attempt,
    RetryPolicy,
    SummaryFailed,
    SummaryOutcome,
    SummaryRequest,
    compute_backoff,
    summarize,
)
from compactd.worker.llm.local import SECTIONS, summarize_local
from compactd.worker.llm.pool import ProviderPool
from compactd.worker.llm.provider import Attribution, Completion
from compactd.worker.llm.usage import Usage

__all__ = [
    "SECTIONS",
    "Attempt",
    "Attribution",
    "Availability",
    "Candidate",
    "Completion",
    "LLMError",
    "LocalSummaryError",
    "ModelFailure",
    "ProviderError",
    "ProviderPool",
    "RetryPolicy",
    "SummaryFailed",
    "SummaryOutcome",
    "SummaryRequest",
    "Unavailable",
    "Usage",
    "candidate_order",
    "compute_backoff",
    "summarize",
    "summarize_local",
]
