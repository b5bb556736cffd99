"""The compaction policy: what the ``summarization:`` block of the configuration says.

Accepts DeerFlow's block verbatim (``enabled``, ``model_name``, ``trigger`` as one ``{type, value}``
or a list of them, ``keep``, ``trim_tokens_to_summarize``, ``summary_prompt``,
``skill_file_read_tool_names``), LangChain's forms (``("tokens", 4000)`` tuples; a list is OR; a
mapping such as ``{"tokens": 4000, "messages": 30}`` is AND), and compactd's own keys.

Silent misconfigurations are load-time errors naming the key path: non-finite numbers (``.nan``
never compares true, so the threshold would be dead), a fraction outside (0, 1] (``80`` meant as
``0.8``), a non-integer or non-positive count (LangChain slices ``messages[-keep:]``), an empty
trigger mapping, a ``summary_prompt`` without ``{messages}``, unknown keys, and a ``keep`` that is
not below the trigger (the kept tail alone would fire it again).

Pure: no I/O. ``resolve`` binds a policy to a run model's context window, dropping ``fraction``
clauses it cannot evaluate (with a warning), as DeerFlow does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from compactd.storage.counters import COUNTERS, TOKENS, Counter
from compactd.worker.compaction.kinds import KINDS, Kind
from compactd.worker.compaction.kinds import base as kind_values

logger = logging.getLogger(__name__)

RENDERS = ("durable_context", "compacted_summary", "langchain")
STRATEGIES = ("chunk", "shrink")
LAYOUTS = ("merge", "recallable")
# Where the keep is measured: at the pickup (the tail the agent holds when it picks the
# checkpoint up, what it appended during the run included) or at the claim (the run's read).
KEEP_AT = ("pickup", "claim")

DEFAULT_KEEP_MESSAGES = 20
DEFAULT_RETAIN_RATIO = 0.16
DEFAULT_TRIM_TOKENS = 4000
DEFAULT_MAX_SUMMARY_TOKENS = 2000
DEFAULT_SKILL_TOOLS = ("read_file", "read", "view", "cat")
DEFAULT_SKILLS_PATH = "/mnt/skills"
# The recallable layout's sizes. A chunk of stale history fits one index call within the default
# trim_tokens_to_summarize beside the instruction and the label allowances, and its index
# checkpoint (the what-happened line, the anchors, the footer: about 100 to 200 tokens) stands
# for it at about a tenth of its size. The index checkpoints together keep to index_max_tokens,
# twice the default max_summary_tokens: what the layout's context costs beyond merge's one
# checkpoint stays that of a second state, and a roll-up (to half of it) comes every ten
# passes or so rather than every pass.
DEFAULT_CHUNK_TOKENS = 2000
DEFAULT_INDEX_SUMMARY_TOKENS = 100
DEFAULT_INDEX_MAX_TOKENS = 4000
PRUNE_THRESHOLD_CHARS = 8192
PRUNE_HEAD_CHARS = 4096
PRUNE_TAIL_CHARS = 1024
# What a pruned tool result holds in place of its middle; it counts toward the pruned length.
PRUNE_MARKER = "\n\n[... tool result middle pruned ...]\n\n"
CLEARED_PLACEHOLDER = "[cleared]"
# A model-free edit (a prune, a clearing) commits on its own only when it frees this many tokens
# while the agent's cache is warm; under it, it rides with the next summary's commit.
# docs/configuration.md's "Cache breaks" derives it from what the re-send of the tokens after
# the edit costs.
DEFAULT_CLEAR_AT_LEAST = 6_400
# How long the agent's provider keeps a cached prefix after its last use: Anthropic's default
# entries live 5 minutes (OpenAI documents 5 to 10 minutes of inactivity); past it the agent's
# next request is uncached anyway, so an edit then costs no re-send.
DEFAULT_CACHE_TTL_S = 300.0


class PolicyError(ValueError):
    """A policy value is not valid; the message starts with its key path."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


def _kind_names() -> str:
    return ", ".join(KINDS)


@dataclass(frozen=True, slots=True)
class Clause:
    kind: str  # a name in ``worker.compaction.kinds.KINDS``
    value: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r} (expected {_kind_names()})")

    @property
    def measure(self) -> Kind:
        """The kind's object: what every decision on this clause asks."""
        return KINDS[self.kind]

    def threshold(self, window: int | None) -> float | None:
        """The count of the kind's counter at which this clause holds; None: not judgeable."""
        return self.measure.threshold(self.value, window)

    def describe(self) -> str:
        return f"{self.kind}>={self.measure.written(self.value)}"

    def to_text(self) -> str:
        """``KIND:N``, the form :func:`parse_keep_text` reads back to an equal clause (a count
        is written whole, never in the exponent form ``:g`` gives a million)."""
        return f"{self.kind}:{self.measure.written(self.value)}"


# A trigger is OR over groups; a group is AND over clauses. ``()`` means automatic compaction is
# off (forced compaction still works).
Trigger = tuple[tuple[Clause, ...], ...]


@dataclass(frozen=True, slots=True)
class PruneConfig:
    enabled: bool = True
    threshold_chars: int = PRUNE_THRESHOLD_CHARS
    head_chars: int = PRUNE_HEAD_CHARS
    tail_chars: int = PRUNE_TAIL_CHARS


@dataclass(frozen=True, slots=True)
class ClearToolUsesConfig:
    """LangChain's ClearToolUsesEdit: above ``trigger`` tokens, clear all but ``keep`` results.
    Its trigger is its own: it fires a model-free run whether or not the summary trigger has.

    ``clear_at_least`` is LangChain's: the clearing stops once it has reclaimed that many
    tokens (0: it clears all it may). Whether what a clearing or a prune freed commits on its
    own is ``Policy.clear_at_least``'s question, Anthropic's sense of the name."""

    enabled: bool = False
    trigger: int = 100_000
    keep: int = 3
    exclude_tools: tuple[str, ...] = ()
    clear_tool_inputs: bool = False
    clear_at_least: int = 0
    placeholder: str = CLEARED_PLACEHOLDER


@dataclass(frozen=True, slots=True)
class ClearThinkingConfig:
    """Anthropic's ``clear_thinking`` context edit, model-free: the reasoning blocks of all but
    the ``keep`` newest assistant messages holding reasoning are dropped
    (``worker.compaction.reasoning``). ``keep`` defaults to Anthropic's default, one turn."""

    keep: int = 1


@dataclass(frozen=True, slots=True)
class Policy:
    enabled: bool = True
    model_name: str | None = None
    trigger: Trigger = ((Clause("fraction", 0.8),),)
    keep: Clause | None = None  # None: retain_ratio of the window, else the last 20 messages
    retain_ratio: float = DEFAULT_RETAIN_RATIO
    trim_tokens_to_summarize: int | None = DEFAULT_TRIM_TOKENS
    summary_prompt: str | None = None
    skill_file_read_tool_names: tuple[str, ...] = DEFAULT_SKILL_TOOLS
    skills_path: str = DEFAULT_SKILLS_PATH
    prune: PruneConfig = field(default_factory=PruneConfig)
    clear_tool_uses: ClearToolUsesConfig = field(default_factory=ClearToolUsesConfig)
    clear_thinking: ClearThinkingConfig | None = None  # None: reasoning is never cleared
    max_summary_tokens: int = DEFAULT_MAX_SUMMARY_TOKENS
    max_rounds: int = 3
    render: str = "durable_context"
    replay_mode: bool = False
    # A summary call made with the session's own run model begins with the runtime's last
    # request (worker.sharing), so the provider reads its input from the agent's prompt cache.
    share_cache: bool = True
    strategy: str = "chunk"
    layout: str = "merge"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    index_summary_tokens: int = DEFAULT_INDEX_SUMMARY_TOKENS
    index_max_tokens: int = DEFAULT_INDEX_MAX_TOKENS
    keep_at: str = "pickup"
    clear_at_least: int = DEFAULT_CLEAR_AT_LEAST
    cache_ttl_s: float = DEFAULT_CACHE_TTL_S
    # Set by ``resolve``: the run model's window, and whether clauses were dropped.
    context_window: int | None = None
    dropped: tuple[str, ...] = ()
    # Set for one run, never configured: what a manual run's summary is asked to focus on
    # (``compact --instructions``, an agent's ``compact_context``), appended to the instruction
    # by ``prompt.focus_block``.
    focus: tuple[str, ...] = ()

    @property
    def auto(self) -> bool:
        """Whether automatic (pressure) compaction can fire at all."""
        return self.enabled and bool(self.trigger)

    def resolve(self, context_window: int | None) -> Policy:
        """Bind to the run model's window: the denominator of every ``fraction``.

        The window is the run model's (the model that would overflow), never the summary
        model's. Without a window, ``fraction`` trigger clauses are dropped with a warning and a
        ``fraction`` keep falls back to the last 20 messages.
        """
        if context_window is not None and context_window > 0:
            return replace(self, context_window=context_window)
        dropped: list[str] = []
        groups: list[tuple[Clause, ...]] = []
        for group in self.trigger:
            if any(c.measure.needs_window for c in group):
                dropped.append(" and ".join(c.describe() for c in group))
                continue
            groups.append(group)
        keep = self.keep
        if keep is not None and keep.measure.needs_window:
            dropped.append(f"keep {keep.describe()}")
            keep = Clause("messages", DEFAULT_KEEP_MESSAGES)
        if dropped:
            logger.warning(
                "fraction clauses dropped: the run model has no known context window",
                extra={"action": "policy.drop_fraction", "dropped": dropped,
                       "auto_off": not groups})
        return replace(self, trigger=tuple(groups), keep=keep, context_window=None,
                       dropped=tuple(dropped))

    def warnings(self) -> tuple[str, ...]:
        """What a resolved policy had to drop, said the way ``compactd status`` shows it."""
        if not self.dropped:
            return ()
        text = ("the run model has no known context window: dropped "
                + "; ".join(self.dropped))
        if self.enabled and not self.trigger:
            text += ("; automatic compaction is OFF for this session (give it a context_window, "
                     "give its run model a context_window under models:, or add a tokens or "
                     "messages trigger)")
        return (text,)

    def threshold_tokens(self) -> float | None:
        """The lowest token count at which some trigger group could fire (for sweeps/metrics)."""
        lows = [c.threshold(self.context_window) for group in self.trigger for c in group
                if c.measure.counter is TOKENS]
        return min((low for low in lows if low is not None), default=None)

    def trigger_floors(self) -> dict[Counter, int | None]:
        """The lowest count of each counter at which the trigger can fire, for a sweep that
        selects on stored columns: it fires only if some counter reaches its floor (None: never
        by that counter). Exact for OR lists of single clauses and for one group; an AND group
        over several counters is floored on its first counter alone (in ``COUNTERS``' order),
        so the floors select a superset that ``should_compact`` narrows. A group with a clause
        that cannot be judged (a fraction without a window) never fires and has no floor."""
        order = list(COUNTERS.values())
        lows: dict[Counter, list[int]] = {counter: [] for counter in order}
        for group in self.trigger if self.auto else ():
            floors = [(c.measure.counter, c.measure.floor(c.value, self.context_window))
                      for c in group]
            if any(floor is None for _, floor in floors):
                continue
            counter = min((counter for counter, _ in floors), key=order.index)
            lows[counter].append(max(f for c, f in floors if c is counter and f is not None))
        return {counter: min(found, default=None) for counter, found in lows.items()}

    def to_config(self) -> dict[str, Any]:
        """A ``summarization:`` mapping that parses back to this policy."""
        out: dict[str, Any] = {
            "enabled": self.enabled, "model_name": self.model_name,
            "trigger": [{c.kind: c.value for c in g} for g in self.trigger],
            "retain_ratio": self.retain_ratio,
            "trim_tokens_to_summarize": self.trim_tokens_to_summarize,
            "summary_prompt": self.summary_prompt,
            "skill_file_read_tool_names": list(self.skill_file_read_tool_names),
            "skills_path": self.skills_path,
            "prune": {"enabled": self.prune.enabled,
                      "threshold_chars": self.prune.threshold_chars,
                      "head_chars": self.prune.head_chars, "tail_chars": self.prune.tail_chars},
            "clear_tool_uses": {
                "enabled": self.clear_tool_uses.enabled, "trigger": self.clear_tool_uses.trigger,
                "keep": self.clear_tool_uses.keep,
                "exclude_tools": list(self.clear_tool_uses.exclude_tools),
                "clear_tool_inputs": self.clear_tool_uses.clear_tool_inputs,
                "clear_at_least": self.clear_tool_uses.clear_at_least,
                "placeholder": self.clear_tool_uses.placeholder},
            "clear_thinking": (None if self.clear_thinking is None
                               else {"keep": self.clear_thinking.keep}),
            "max_summary_tokens": self.max_summary_tokens, "max_rounds": self.max_rounds,
            "render": self.render, "replay_mode": self.replay_mode,
            "share_cache": self.share_cache, "strategy": self.strategy,
            "layout": self.layout, "chunk_tokens": self.chunk_tokens,
            "index_summary_tokens": self.index_summary_tokens,
            "index_max_tokens": self.index_max_tokens, "keep_at": self.keep_at,
            "clear_at_least": self.clear_at_least, "cache_ttl_s": self.cache_ttl_s,
        }
        if self.keep is not None:
            out["keep"] = {"type": self.keep.kind, "value": self.keep.value}
        return out


# ------------------------------------------------------------------------------------------
# parsing

_TOP_KEYS = {
    "enabled", "model_name", "trigger", "keep", "trim_tokens_to_summarize", "summary_prompt",
    "skill_file_read_tool_names", "skills_path", "prune", "clear_tool_uses", "retain_ratio",
    "clear_thinking", "max_summary_tokens", "max_rounds", "render", "replay_mode",
    "share_cache", "strategy", "layout", "chunk_tokens", "index_summary_tokens",
    "index_max_tokens", "keep_at", "clear_at_least", "cache_ttl_s",
}
_PRUNE_KEYS = {"enabled", "threshold_chars", "head_chars", "tail_chars"}
_CLEAR_THINKING_KEYS = {"keep"}
_CLEAR_KEYS = {"enabled", "trigger", "keep", "exclude_tools", "clear_tool_inputs",
               "clear_at_least", "placeholder"}


def _parse_keep(value: Any, path: str, base: Policy) -> Clause | None:
    return None if value is None else parse_clause(value, path)


def _parse_trim(value: Any, path: str, base: Policy) -> int | None:
    return None if value is None else _count(value, path)


def _parse_prompt(value: Any, path: str, base: Policy) -> str | None:
    prompt = _opt_str(value, path)
    if prompt is not None and "{messages}" not in prompt:
        raise PolicyError(path, "a custom prompt must contain the {messages} placeholder")
    return prompt


# One parser per top-level key, each given the value, its path and the base policy, in the
# order the keys are checked (so a mapping with two bad keys is refused for the same one).
_FIELD_PARSERS: tuple[tuple[str, Callable[[Any, str, Policy], Any]], ...] = (
    ("enabled", lambda v, p, _: _bool(v, p)),
    ("model_name", lambda v, p, _: _opt_str(v, p)),
    ("trigger", lambda v, p, _: parse_trigger(v, p)),
    ("keep", _parse_keep),
    ("retain_ratio", lambda v, p, _: _fraction(v, p)),
    ("trim_tokens_to_summarize", _parse_trim),
    ("summary_prompt", _parse_prompt),
    ("skill_file_read_tool_names", lambda v, p, _: _str_list(v, p)),
    ("skills_path", lambda v, p, _: _str(v, p)),
    ("prune", lambda v, p, base: _parse_prune(v, p, base.prune)),
    ("clear_tool_uses", lambda v, p, base: _parse_clear(v, p, base.clear_tool_uses)),
    ("clear_thinking", lambda v, p, _: _parse_clear_thinking(v, p)),
    ("max_summary_tokens", lambda v, p, _: _count(v, p)),
    ("max_rounds", lambda v, p, _: _count(v, p)),
    ("render", lambda v, p, _: _choice(v, RENDERS, p)),
    ("replay_mode", lambda v, p, _: _bool(v, p)),
    ("share_cache", lambda v, p, _: _bool(v, p)),
    ("strategy", lambda v, p, _: _choice(v, STRATEGIES, p)),
    ("layout", lambda v, p, _: _choice(v, LAYOUTS, p)),
    ("keep_at", lambda v, p, _: _choice(v, KEEP_AT, p)),
    ("chunk_tokens", lambda v, p, _: _count(v, p)),
    ("index_summary_tokens", lambda v, p, _: _count(v, p)),
    ("index_max_tokens", lambda v, p, _: _count(v, p)),
    ("clear_at_least", lambda v, p, _: _count(v, p, allow_zero=True)),
    ("cache_ttl_s", lambda v, p, _: _seconds(v, p)),
)

def parse_policy(raw: Mapping[str, Any] | None, *, path: str = "summarization",
                 base: Policy | None = None, check_keep: bool = True) -> Policy:
    """A policy from a ``summarization:`` mapping; keys not given keep ``base``'s values.

    ``check_keep=False`` skips :func:`check_keep_below_trigger`, for a session's stored overrides
    read back at run time: they were checked when the session was created, and a configuration
    changed since must not make a stored session unreadable to sweeps and runs (the loop guard
    deals with a keep that refires)."""
    policy = base or Policy()
    if raw is None:
        return policy
    if not isinstance(raw, Mapping):
        raise PolicyError(path, f"must be a mapping, got {type(raw).__name__}")
    if "lease_s" in raw:
        # It was accepted once and never used: refused by name, so a config that sets it
        # learns where the lease is configured instead of a bare "unknown key".
        raise PolicyError(f"{path}.lease_s", "no longer supported: a lease belongs to the "
                          "worker that holds it; set worker.lease_s")
    _no_unknown(raw, _TOP_KEYS, path)
    changes = {key: parse(raw[key], f"{path}.{key}", policy)
               for key, parse in _FIELD_PARSERS if key in raw}
    out = replace(policy, **changes)
    check_layout_sizes(out, path, given=changes)
    if check_keep:
        check_keep_below_trigger(out, path)
    return out


def check_layout_sizes(policy: Policy, path: str, given: Mapping[str, Any]) -> None:
    """The recallable layout's sizes, against each other (the key named is one the mapping
    gave, where it gave one)."""
    def key(*names: str) -> str:
        return f"{path}.{next((n for n in names if n in given), names[0])}"

    if policy.index_summary_tokens >= policy.chunk_tokens:
        raise PolicyError(key("index_summary_tokens", "chunk_tokens"),
                          f"index_summary_tokens ({policy.index_summary_tokens}) must be below "
                          f"chunk_tokens ({policy.chunk_tokens}): an index checkpoint stands "
                          "for its chunk in fewer tokens")
    if policy.layout == "recallable":
        for g, group in enumerate(policy.trigger):
            tokens = [c.value for c in group if c.kind == "tokens"]
            if len(tokens) == len(group) and max(tokens) <= policy.index_max_tokens:
                raise PolicyError(key("index_max_tokens", "trigger", "layout"),
                                  f"index_max_tokens ({policy.index_max_tokens}) must be below "
                                  f"trigger group {g} (tokens>={int(max(tokens))}): the index "
                                  "checkpoints alone would fire it again")
    if policy.index_max_tokens < 4 * policy.index_summary_tokens:
        raise PolicyError(key("index_max_tokens", "index_summary_tokens"),
                          f"index_max_tokens ({policy.index_max_tokens}) must be at least 4 "
                          f"times index_summary_tokens ({policy.index_summary_tokens}): a "
                          "roll-up brings the index checkpoints to half of it, which must hold "
                          "the roll-up and the next pass's index checkpoints")


def parse_trigger(raw: Any, path: str) -> Trigger:
    """OR over groups. Accepted items: ``{type, value}`` (DeerFlow), ``[kind, value]`` tuples
    (LangChain), and ``{kind: value, ...}`` mappings (AND, LangChain's TriggerClause)."""
    if raw is None:
        return ()
    items = raw if _is_list(raw) and not _is_pair(raw) else [raw]
    groups: list[tuple[Clause, ...]] = []
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if items is raw else path
        if isinstance(item, Mapping) and "type" not in item:
            if not item:
                raise PolicyError(where, "an empty trigger mapping never fires; "
                                         "give at least one of tokens, messages, fraction")
            clauses = []
            for kind, value in item.items():
                if kind not in KINDS:
                    raise PolicyError(f"{where}.{kind}",
                                      f"unknown trigger kind (expected {_kind_names()})")
                clauses.append(_clause(kind, value, f"{where}.{kind}"))
            groups.append(tuple(clauses))
        else:
            groups.append((parse_clause(item, where),))
    return tuple(groups)


def parse_clause(raw: Any, path: str) -> Clause:
    """One ``{type, value}`` mapping, ``[kind, value]`` pair, or one-key ``{kind: value}``."""
    if isinstance(raw, Mapping):
        if "type" in raw:
            _no_unknown(raw, {"type", "value"}, path)
            if "value" not in raw:
                raise PolicyError(f"{path}.value", "missing")
            kind, value = raw["type"], raw["value"]
            value_path = f"{path}.value"
        elif len(raw) == 1:
            kind, value = next(iter(raw.items()))
            value_path = f"{path}.{kind}"
        else:
            raise PolicyError(path, "expected {type: KIND, value: N}")
    elif _is_pair(raw):
        kind, value = raw[0], raw[1]
        value_path = f"{path}[1]"
    else:
        raise PolicyError(path, "expected {type: KIND, value: N} or [KIND, N]")
    if kind not in KINDS:
        raise PolicyError(f"{path}.type" if isinstance(raw, Mapping) else f"{path}[0]",
                          f"unknown kind {kind!r} (expected {_kind_names()})")
    return _clause(kind, value, value_path)


def parse_keep_text(text: str, path: str = "keep") -> Clause:
    """A keep override as ``KIND:N`` (``messages:12``, ``tokens:3000``, ``fraction:0.2``): the one
    reader of the form the CLI, the HTTP API, the client and the queued task pass along."""
    kind, sep, value = text.partition(":")
    if not sep:
        raise PolicyError(path, f"expected KIND:N ({_kind_names()}), got {text!r}")
    if kind not in KINDS:
        raise PolicyError(path, f"unknown kind {kind!r} (expected {_kind_names()})")
    try:
        number = float(value)
    except ValueError:
        raise PolicyError(path, f"expected KIND:N with a number after the colon, "
                                f"got {text!r}") from None
    return _clause(kind, int(number) if number.is_integer() else number, path)


def _clause(kind: str, value: Any, path: str) -> Clause:
    try:
        return Clause(kind, KINDS[kind].check(value))
    except ValueError as exc:
        raise PolicyError(path, str(exc)) from None


def effective_keep(keep: Clause | None, retain_ratio: float, context_window: int | None
                   ) -> Clause:
    """The keep a run uses: ``keep``, else ``retain_ratio`` of the run model's window; a
    ``fraction`` without a window falls back to the last 20 messages."""
    if keep is None:
        return (Clause("fraction", retain_ratio) if context_window
                else Clause("messages", DEFAULT_KEEP_MESSAGES))
    if keep.measure.needs_window and not context_window:
        return Clause("messages", DEFAULT_KEEP_MESSAGES)
    return keep


# A window of unknown size, for the load-time check: fraction against fraction can be judged
# whatever the window is, tokens against fraction only once a session knows its window.
ANY_WINDOW = -1


def keep_refires(policy: Policy, context_window: int | None) -> str | None:
    """Why the kept tail alone would fire the trigger again, or None.

    ``context_window``: the run model's window, None for a session without one (its fraction
    clauses never fire, its fraction keep is the last 20 messages), or :data:`ANY_WINDOW`. A
    group fires again when the tail meets every one of its clauses (AND); a clause of another
    kind than the keep (messages against tokens) is not met by the tail as far as anyone can
    know, so a group holding one is not refused.
    """
    windowed = context_window is not None
    window = context_window if windowed and context_window != ANY_WINDOW else None
    keep = effective_keep(policy.keep, policy.retain_ratio, context_window)
    for g, group in enumerate(policy.trigger):
        if not windowed and any(c.measure.needs_window for c in group):
            continue
        if all(_tail_meets(keep, clause, window) for clause in group):
            what = " and ".join(c.describe() for c in group)
            source = " (retain_ratio)" if policy.keep is None and keep.measure.needs_window else (
                " (the default keep)" if policy.keep is None else "")
            of = f" of a {window}-token window" if window else ""
            return (f"keep {keep.describe()}{source} is not below trigger {what}{of} "
                    f"(group {g}): the kept tail alone would fire the trigger again")
    return None


def _tail_meets(keep: Clause, clause: Clause, window: int | None) -> bool:
    if keep.kind == clause.kind:
        return keep.value >= clause.value
    if keep.measure.counter is not clause.measure.counter:
        return False
    kept, needed = keep.threshold(window), clause.threshold(window)
    return kept is not None and needed is not None and kept >= needed


def check_keep_below_trigger(policy: Policy, path: str,
                             windows: Sequence[tuple[str, int | None]] = ()) -> None:
    """Refuse a policy whose kept tail would fire its trigger again: for a session without a
    window, for one with any window, and for each ``(name, window)`` given."""
    for name, window in (("", None), ("", ANY_WINDOW), *windows):
        why = keep_refires(policy, window)
        if why is not None:
            key = "retain_ratio" if policy.keep is None and "(retain_ratio)" in why else "keep"
            raise PolicyError(f"{path}.{key}", why + (f" for {name}" if name else ""))


def _parse_prune(raw: Any, path: str, base: PruneConfig) -> PruneConfig:
    if isinstance(raw, bool):
        return replace(base, enabled=raw)
    if not isinstance(raw, Mapping):
        raise PolicyError(path, "must be a mapping or a boolean")
    _no_unknown(raw, _PRUNE_KEYS, path)
    # Either end may be 0: the end of a build log alone (head 0) is what is often wanted.
    changes: dict[str, Any] = {k: (_bool(v, f"{path}.{k}") if k == "enabled"
                                   else _count(v, f"{path}.{k}",
                                               allow_zero=k in ("head_chars", "tail_chars")))
                               for k, v in raw.items()}
    out = replace(base, **changes)
    if out.head_chars == 0 and out.tail_chars == 0:
        raise PolicyError(path, "head_chars and tail_chars cannot both be 0: a pruned result "
                                "keeps its head, its tail or both")
    kept = out.head_chars + len(PRUNE_MARKER) + out.tail_chars
    if kept >= out.threshold_chars:
        raise PolicyError(path, f"head_chars + tail_chars + the {len(PRUNE_MARKER)}-character "
                                f"marker ({kept}) must be below threshold_chars "
                                f"({out.threshold_chars}), or pruning would not shrink anything")
    return out


def _parse_clear(raw: Any, path: str, base: ClearToolUsesConfig) -> ClearToolUsesConfig:
    if isinstance(raw, bool):
        return replace(base, enabled=raw)
    if not isinstance(raw, Mapping):
        raise PolicyError(path, "must be a mapping or a boolean")
    _no_unknown(raw, _CLEAR_KEYS, path)
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key in ("enabled", "clear_tool_inputs"):
            changes[key] = _bool(value, where)
        elif key == "trigger":
            changes[key] = _count(value, where)
        elif key in ("keep", "clear_at_least"):
            changes[key] = _count(value, where, allow_zero=True)
        elif key == "exclude_tools":
            changes[key] = _str_list(value, where)
        elif key == "placeholder":
            changes[key] = _str(value, where)
    return replace(base, **changes)


def _parse_clear_thinking(raw: Any, path: str) -> ClearThinkingConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise PolicyError(path, "must be a mapping such as {keep: 1}, or null")
    _no_unknown(raw, _CLEAR_THINKING_KEYS, path)
    if "keep" not in raw:
        return ClearThinkingConfig()
    return ClearThinkingConfig(keep=_count(raw["keep"], f"{path}.keep", allow_zero=True))


# ------------------------------------------------------------------------------------------
# scalar checks


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _is_pair(value: Any) -> bool:
    return _is_list(value) and len(value) == 2 and isinstance(value[0], str)


def _number(value: Any, path: str) -> float:
    try:
        return kind_values.number(value)
    except ValueError as exc:
        raise PolicyError(path, str(exc)) from None


def _fraction(value: Any, path: str) -> float:
    try:
        return kind_values.fraction(value)
    except ValueError as exc:
        raise PolicyError(path, str(exc)) from None


def _count(value: Any, path: str, *, allow_zero: bool = False) -> int:
    try:
        return kind_values.count(value, allow_zero=allow_zero)
    except ValueError as exc:
        raise PolicyError(path, str(exc)) from None


def _seconds(value: Any, path: str) -> float:
    v = _number(value, path)
    if v < 0:
        raise PolicyError(path, f"must be non-negative seconds, got {value!r}")
    return v


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(path, f"must be true or false, got {value!r}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise PolicyError(path, f"must be a non-empty string, got {value!r}")
    return value


def _opt_str(value: Any, path: str) -> str | None:
    return None if value is None else _str(value, path)


def _str_list(value: Any, path: str) -> tuple[str, ...]:
    if not _is_list(value):
        raise PolicyError(path, f"must be a list of strings, got {value!r}")
    return tuple(_str(v, f"{path}[{i}]") for i, v in enumerate(value))


def _choice(value: Any, choices: tuple[str, ...], path: str) -> str:
    if value not in choices:
        raise PolicyError(path, f"must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _no_unknown(raw: Mapping[str, Any], known: set[str], path: str) -> None:
    for key in raw:
        if key not in known:
            raise PolicyError(f"{path}.{key}",
                              f"unknown key (expected one of {', '.join(sorted(known))})")
