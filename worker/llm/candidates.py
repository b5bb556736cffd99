"""Which models may write a session's summary, in which order (model ownership, DeerFlow).

* No summary model configured: the session's run model summarizes. A run model that is healthy
  keeps compaction working even when some other configured model's provider is broken.
* A summary model configured (``summarization.model_name``): it goes first, the run model
  follows, so a broken summary provider cannot disable compaction while another model works.
* Then the configured ``default_model``, then ``local`` (model-free) when ``local_fallback`` is on.
* De-duplicated by name and by endpoint: two names for the same provider/model/URL/key are one
  candidate, because calling the same failing endpoint twice only doubles the wait.

A name that is not in ``models:`` (typically a session's run model that the operator never
declared) is skipped with one warning per name per process. It is never guessed into a provider
from its spelling: that would spend an ambient ``OPENAI_API_KEY`` on a model nobody configured.
``local`` needs no entry. With no models configured at all, ``local`` is the embedded default
whatever ``local_fallback`` says, so a bare machine still compacts.

:class:`Availability` remembers candidates whose client could not be built (or whose provider
said the key or model is wrong) for ``unavailable_model_s``, so a broken entry costs one warning,
not one failed call per compaction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from compactd.worker.settings import LOCAL_MODEL, ModelSpec

logger = logging.getLogger(__name__)

_warned_unknown: set[str] = set()
_warned_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Candidate:
    """One model that may write the summary. ``spec`` is None only for the built-in ``local``."""

    name: str
    provider: str
    model_id: str
    spec: ModelSpec | None = None

    @property
    def is_local(self) -> bool:
        return self.provider == "local"

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> Candidate:
        return cls(name=spec.name, provider=spec.provider, model_id=spec.model_id, spec=spec)

    @classmethod
    def local(cls) -> Candidate:
        return cls(name=LOCAL_MODEL, provider="local", model_id=LOCAL_MODEL)

    def endpoint(self) -> tuple[str, ...]:
        """What makes two entries the same model to call."""
        if self.is_local:
            return ("local",)
        spec = self.spec
        return (self.provider, self.model_id, (spec.base_url or "") if spec else "",
                (spec.api_key_env or "") if spec else "")


def candidate_order(*, run_model: str | None, summary_model: str | None,
                    models: Sequence[ModelSpec], default_model: str | None,
                    local_fallback: bool) -> list[Candidate]:
    """The candidates to try, in order; see the module docstring for the rules."""
    by_name = {spec.name: spec for spec in models}
    names: list[str | None] = [summary_model, run_model, default_model]
    if local_fallback or not models:
        names.append(LOCAL_MODEL)
    out: list[Candidate] = []
    seen_names: set[str] = set()
    seen_endpoints: set[tuple[str, ...]] = set()
    for name in names:
        if not name or name in seen_names:
            continue
        seen_names.add(name)
        spec = by_name.get(name)
        if spec is not None:
            candidate = Candidate.from_spec(spec)
        elif name == LOCAL_MODEL:
            candidate = Candidate.local()
        else:
            if models:
                # With no models configured at all (the embedded default) every run model is
                # unknown by design: the local summarizer is the answer, not a warning.
                _warn_unknown(name)
            continue
        if candidate.endpoint() in seen_endpoints:
            continue
        seen_endpoints.add(candidate.endpoint())
        out.append(candidate)
    return out


def _warn_unknown(name: str) -> None:
    with _warned_lock:
        if name in _warned_unknown:
            return
        _warned_unknown.add(name)
    logger.warning("model %r is not in models: it cannot summarize", name,
                   extra={"action": "llm.unknown_model", "model": name})


class Availability:
    """Candidates remembered as unusable, each until its entry expires.

    Shared by every event loop and thread of a process (the clients are per loop, the memory of
    which entries are broken is not). ``clock`` is injectable so tests can move time.
    """

    def __init__(self, ttl_s: float = 300.0, *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._until: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def reason(self, name: str) -> str | None:
        """Why ``name`` is unavailable now, or None if it may be tried."""
        with self._lock:
            entry = self._until.get(name)
            if entry is None:
                return None
            until, reason = entry
            if self._clock() >= until:
                del self._until[name]
                return None
            return reason

    def mark(self, name: str, reason: str) -> bool:
        """Remember ``name`` as unavailable; True if it was not already (warn once)."""
        with self._lock:
            now = self._clock()
            entry = self._until.get(name)
            fresh = entry is None or now >= entry[0]
            if fresh:
                self._until[name] = (now + self.ttl_s, reason)
            return fresh

    def clear(self, name: str | None = None) -> None:
        with self._lock:
            if name is None:
                self._until.clear()
            else:
                self._until.pop(name, None)
