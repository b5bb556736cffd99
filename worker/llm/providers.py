"""The providers compactd can call, by the name a model's ``provider`` field gives: the
registry that builds a client for a remote candidate (:func:`build_provider`).

Each provider lives in its own module with its own SDK's error translation:
:mod:`worker.llm.openai_provider` (``openai`` and ``openai-compatible``) and
:mod:`worker.llm.anthropic_provider`. The local summarizer (:mod:`worker.llm.local`) needs no
client and is not here.

Each SDK is imported when the first client of its kind is built, not with this module: importing
``anthropic`` or ``openai`` costs a large part of a process's start-up CPU, paid by every worker
start, CLI ``compact --inline`` and test process, most of which never use both. A worker imports
the SDKs its configured models need (:func:`import_sdks`) when it starts, before it consumes: an
import inside the loop would stall every compaction in flight, and calls held back by a rate meter
would then all leave at once, over the provider's quota.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from compactd.worker.llm import anthropic_provider, openai_provider
from compactd.worker.llm.candidates import Candidate
from compactd.worker.llm.provider import Attribution, BuildError, Provider
from compactd.worker.settings import ModelSpec


@dataclass(frozen=True, slots=True)
class ProviderKind:
    """How to build a client for one ``provider`` name."""

    sdk: str  # the module :func:`import_sdks` imports ahead
    key_env: str | None  # the API key's environment variable when the model names none
    build: Callable[[Candidate, str | None, Attribution], Provider]


PROVIDERS: Mapping[str, ProviderKind] = {
    "openai": ProviderKind("openai", "OPENAI_API_KEY", openai_provider.build),
    "openai-compatible": ProviderKind("openai", None, openai_provider.build),
    "anthropic": ProviderKind("anthropic", "ANTHROPIC_API_KEY", anthropic_provider.build),
}


def import_sdks(models: Iterable[ModelSpec]) -> list[str]:
    """Import the SDK of every remote provider among ``models``; the modules imported."""
    names = sorted({PROVIDERS[m.provider].sdk for m in models if m.provider in PROVIDERS})
    for name in names:
        importlib.import_module(name)
    return names


def build_provider(candidate: Candidate, *, attribution: Attribution,
                   env: Mapping[str, str]) -> Provider:
    """A provider for ``candidate``; raises :class:`BuildError` naming what is missing."""
    spec = candidate.spec
    if spec is None or candidate.is_local:
        raise BuildError(f"{candidate.name} is not a remote model")
    kind = PROVIDERS.get(spec.provider)
    key_env = spec.api_key_env or (kind.key_env if kind is not None else None)
    key = env.get(key_env) if key_env else None
    if key_env and not key:
        raise BuildError(f"environment variable {key_env} is not set")
    if kind is None:
        raise BuildError(f"unknown provider {spec.provider!r}")
    return kind.build(candidate, key, attribution)
