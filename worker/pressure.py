"""A session's policy and pressure from its cached totals: what signals, sweeps and the hot path
decide on without reading the surface.

The policy is the configured one with the session's overrides on top, bound to the run model's
context window (the session's own, else the configured model's, else a known public figure).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from compactd.storage.errors import ConfigError
from compactd.storage.records import SessionInfo, utcnow
from compactd.storage.surface import Surface
from compactd.worker.compaction.lead import lead_tokens, step_lead_tokens
from compactd.worker.compaction.policy import (
    Policy,
    PolicyError,
    check_keep_below_trigger,
    parse_policy,
)
from compactd.worker.compaction.triggers import (
    Pressure,
    pressure_tokens,
    should_compact,
    should_run,
    surface_counts,
)
from compactd.worker.settings import Config

# Published context windows of common run models, used only when neither the session nor the
# configuration names one (a fraction trigger is otherwise dropped). Longest prefix wins.
KNOWN_WINDOWS: dict[str, int] = {
    "gpt-4o": 128_000, "gpt-4o-mini": 128_000, "gpt-4.1": 1_047_576, "gpt-4-turbo": 128_000,
    "gpt-4": 8_192, "gpt-3.5-turbo": 16_385, "gpt-5": 400_000, "o1": 200_000, "o3": 200_000,
    "o4-mini": 200_000, "claude": 200_000, "deepseek-chat": 128_000,
    "deepseek-reasoner": 128_000,
}


def known_window(run_model: str | None) -> int | None:
    name = (run_model or "").lower().rsplit("/", 1)[-1]
    best = None
    for prefix, window in KNOWN_WINDOWS.items():
        if name.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, window)
    return best[1] if best else None


def window_for(config: Config, run_model: str | None, given: int | None = None) -> int | None:
    """The window a session on ``run_model`` has: ``given`` (the session's own, or the one its
    caller names), else the configured model's, else the known one for its name."""
    return given or config.context_window(run_model) or known_window(run_model)


def context_window(info: SessionInfo, config: Config) -> int | None:
    return window_for(config, info.run_model, info.context_window)


def check_session_policy(overrides: dict[str, Any] | None, config: Config, *,
                         run_model: str | None, context_window: int | None) -> Policy:
    """The policy a new or updated session would run under, refused (a ``ConfigError`` naming
    its path under ``policy``, or under ``summarization`` when the session has no overrides)
    when it is bad or when its kept tail alone would fire its trigger under the window the
    session will have: what only the window decides is checked here, not at load."""
    window = window_for(config, run_model, context_window)
    path = "policy" if overrides else "summarization"
    try:
        policy = parse_policy(overrides, path="policy", base=config.policy)
        if window:
            check_keep_below_trigger(policy, path, [("this session's window", window)])
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    return policy


@lru_cache(maxsize=4096)
def _resolved(base: Policy, overrides_json: str, window: int | None) -> Policy:
    overrides: dict[str, Any] | None = json.loads(overrides_json) if overrides_json else None
    return parse_policy(overrides, path="session.policy", base=base,
                        check_keep=False).resolve(window)


def session_policy(info: SessionInfo, config: Config) -> Policy:
    """The policy this session runs under, resolved to its run model's window."""
    overrides = json.dumps(info.policy, sort_keys=True) if info.policy else ""
    return _resolved(config.policy, overrides, context_window(info, config))


# The share of a window a session may fill when its trigger cannot say (no token threshold, or
# one at or beyond the window): the default trigger's, so the rest is the reply's reserve.
DEFAULT_FILL = 0.8


@dataclass(frozen=True, slots=True)
class WindowFit:
    """Whether a session fits a run model's window: its pressure now, and the reserve the
    window must keep free besides it (what the session's trigger keeps free on that window:
    the room for the model's reply and the growth before the next checkpoint)."""

    window: int
    tokens: int
    reserve: int
    # What a run that makes the session fit keeps verbatim: the newest messages up to the
    # policy's retain ratio of the window, the rest summarized.
    keep_tokens: int

    @property
    def fits(self) -> bool:
        return self.tokens + self.reserve <= self.window

    def to_json(self) -> dict[str, Any]:
        return {"window": self.window, "tokens": self.tokens, "reserve": self.reserve,
                "fits": self.fits}


def window_fit(info: SessionInfo, config: Config, *, run_model: str | None,
               window: int) -> WindowFit:
    """How the session as it stands fits ``window``, the window of ``run_model``: the reserve
    is what its trigger, resolved on that window, leaves free above it."""
    moved = dataclasses.replace(info, run_model=run_model, context_window=window)
    policy = session_policy(moved, config)
    threshold = policy.threshold_tokens()
    fill = threshold if threshold is not None and threshold < window else window * DEFAULT_FILL
    return WindowFit(window=window, tokens=session_pressure(info, policy).tokens,
                     reserve=window - int(fill),
                     keep_tokens=max(1, int(window * policy.retain_ratio)))


def session_pressure(info: SessionInfo, policy: Policy) -> Pressure:
    """Pressure from the cached totals: surface (checkpoints included) plus envelope, or the
    provider's own count when it reported a larger one (``storage.schema``'s
    ``OVER_SWEEP_SQL`` is the same measure in SQL)."""
    tokens = pressure_tokens(info.surface_tokens, info.envelope_tokens, info.reported_tokens)
    window = policy.context_window
    return Pressure(tokens=tokens, messages=info.surface_messages,
                    fraction=tokens / window if window else None, counts=info.counts or {})


# ``checkpoint_leads.source`` of an ``auto`` lead before any run is measured.
FIRST = "first"


def session_lead_s(info: SessionInfo, config: Config) -> float:
    """The seconds ``info``'s session fires early by (``worker.lead``): the configured lead,
    else its pool's as its last append read it, else (no lead stored yet: a deployment whose
    sweep and workers have not refreshed the leads since it started) the first lead. A
    measured lead is never 0 (a run takes time), so 0 read under ``auto`` is no row."""
    if config.lead is not None:
        return config.lead
    return info.lead_s or config.first_lead_s


@dataclass(frozen=True, slots=True)
class LeadParts:
    """What the session's pressure counts ahead of its tokens, and its two sources."""

    growth: int  # its growth over the lead at its current rate, capped
    step: int  # its largest recent step, capped (0: lead_steps off, or lead 0)

    @property
    def tokens(self) -> int:
        return max(self.growth, self.step)


def lead_parts(info: SessionInfo, policy: Policy, config: Config,
               now: dt.datetime | None = None) -> LeadParts:
    """The session's growth over its lead and its next step (``worker.compaction.lead``).
    ``summarization.lead: 0`` turns both off: the session fires at its trigger."""
    grown = (None if info.compacted_tokens is None
             else session_pressure(info, policy).tokens - info.compacted_tokens)
    threshold = policy.threshold_tokens()
    growth = lead_tokens(info.growth_at(now or utcnow()), session_lead_s(info, config),
                         threshold, grown)
    steps = config.lead_steps and config.lead != 0
    return LeadParts(growth,
                     step_lead_tokens(info.step_tokens, threshold, grown) if steps else 0)


def ahead_tokens(info: SessionInfo, policy: Policy, config: Config,
                  now: dt.datetime | None = None) -> int:
    """The tokens the session may add before a checkpoint asked for now lands: the larger of
    its growth over the lead and its next step (:func:`lead_parts`). What its pressure counts
    when it decides whether to fire."""
    return lead_parts(info, policy, config, now).tokens


def lead_pressure(info: SessionInfo, policy: Policy, config: Config,
                  now: dt.datetime | None = None) -> Pressure:
    """The session's pressure when a checkpoint asked for now would land: what every automatic
    decision (the append's signal, the sweep, the reaper, the follow-up) fires on. The sweep's
    stored flag counts the uncapped growth over the same lead, not the step: a session only
    its step fires early, whose signal was lost, the sweep finds at its trigger."""
    return session_pressure(info, policy).ahead_by(ahead_tokens(info, policy, config, now),
                                                   policy.context_window)


def read_pressure(info: SessionInfo, surface: Surface, policy: Policy) -> Pressure:
    """Pressure of the surface a run read, with the session's envelope and usage report: what
    a plan made on that read replaces tokens from. ``info`` may be older than the read (the
    claim's row, while appends went on), and its cached totals then undercount what the plan
    replaces; the read itself never does."""
    read = dataclasses.replace(info, surface_tokens=surface.tokens,
                               surface_messages=len(surface.nodes),
                               counts=surface_counts(surface.nodes))
    return session_pressure(read, policy)


@dataclass(frozen=True, slots=True)
class Runway:
    """How long a session has before its run model's window at its current growth."""

    session: str
    seconds: float  # 0 when already at or past the window
    tokens: int
    window: int
    rate_per_s: float

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "runway_s": round(self.seconds, 1),
                "tokens": self.tokens, "window": self.window,
                "rate_per_s": round(self.rate_per_s, 2)}


def runway(info: SessionInfo, config: Config, now: dt.datetime) -> Runway | None:
    """The session's runway, None when it is not growing or has no known window (no window to
    reach, or never reached)."""
    policy = session_policy(info, config)
    window = policy.context_window
    rate = info.growth_rate_at(now)
    if not window or rate <= 0:
        return None
    tokens = session_pressure(info, policy).tokens
    return Runway(info.id, max(0.0, (window - tokens) / rate), tokens, window, rate)


def sorted_runways(infos: Iterable[SessionInfo], config: Config, now: dt.datetime
                  ) -> list[Runway]:
    """The measurable runways of ``infos``, least first."""
    found = (runway(info, config, now) for info in infos)
    return sorted((r for r in found if r is not None), key=lambda r: (r.seconds, r.session))


def held_back(info: SessionInfo, pressure: Pressure) -> bool:
    """Whether the session waits for growth before it fires again: a run found nothing worth
    doing until it grows past ``refire_tokens`` (``worker.compaction.refire``): it could not
    bring the session under its trigger, or its lead fired it early while a long message held
    its kept tail (:func:`waiting_why`). A commit that replaced part of the surface since (its
    ``compacted_version`` moved) ends the wait, and so does the run model's window: there a run
    summarizes whatever it frees (``cache_breaks.hold_edits``), so the wait never lets a session
    reach it."""
    at_window = pressure.fraction is not None and pressure.fraction >= 1
    return (info.refire_tokens is not None and info.refire_version == info.compacted_version
            and pressure.tokens < info.refire_tokens and not at_window)


def waiting_why(pressure: Pressure, policy: Policy) -> str:
    """Why a session held back (:func:`held_back`) waits: which of the two runs that name a
    growth to wait for left it so."""
    if should_compact(pressure, policy)[0]:
        return "the last run could not bring it under its trigger"
    return ("the last run, fired early by its lead, waits for a long message to leave its "
            "kept tail")


def over_trigger(info: SessionInfo, config: Config, now: dt.datetime | None = None) -> bool:
    """Over the summary trigger when a checkpoint would land, and not waiting for the growth
    a run named (:func:`held_back`): what sweeps and the reaper look for."""
    policy = session_policy(info, config)
    return (should_compact(lead_pressure(info, policy, config, now), policy)[0]
            and not held_back(info, session_pressure(info, policy)))


def wants_run(info: SessionInfo, config: Config, now: dt.datetime | None = None) -> bool:
    """Over the summary trigger or clearing's own: what an append or a signal wakes a run for.
    Sweeps do not look for clearing: the next append signals again, and a session whose old
    results are all cleared would otherwise be read by a run every sweep interval."""
    return explain(info, config, now)[0]


def explain(info: SessionInfo, config: Config, now: dt.datetime | None = None
            ) -> tuple[bool, str, Pressure]:
    policy = session_policy(info, config)
    pressure = session_pressure(info, policy)
    fired, reason = should_run(pressure, policy,
                               lead_tokens=ahead_tokens(info, policy, config, now))
    if fired and held_back(info, pressure):
        return False, (f"{reason}; waits until {info.refire_tokens} tokens: "
                       f"{waiting_why(pressure, policy)}"), pressure
    return fired, reason, pressure


def sweep_key(config: Config) -> str:
    """Names what a session's sweep thresholds were resolved from: the configured trigger and
    the windows a session's run model can take. A change to either gives a new key, and the
    sweep resolves every session again; other settings leave the thresholds as they are."""
    windows = [(m.name, m.context_window) for m in config.models]
    p = config.policy
    basis = repr((p.enabled, p.trigger, windows, sorted(KNOWN_WINDOWS.items())))
    return hashlib.sha256(basis.encode()).hexdigest()[:32]


def sweep_thresholds(info: SessionInfo, config: Config) -> dict[str, int | None]:
    """The stored thresholds the sweep selects on, by counter (see ``Policy.trigger_floors``)."""
    floors = session_policy(info, config).trigger_floors()
    return {counter.name: floor for counter, floor in floors.items()}
