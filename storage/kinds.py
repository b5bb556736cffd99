"""The names of compactd's closed sets, in one place.

Each set is a :class:`enum.StrEnum`: a member is the string it stands for, so it compares equal
to what the database, a JSON body, a Celery result or a Prometheus label holds, and serializes as
that string. The SQL compares the same words (``storage/sql/``); ``tests/unit/test_kinds.py``
holds every literal there to these members, and fails on a literal of them in a production
module.

The sets:

* :class:`NodeKind`: the events that put a node on the surface; :class:`JournalKind`: the events
  that only record a run (see ``storage.surface``). Together they are an event's ``kind``.
* :class:`RunStatus`: a run row's ``status`` (a run's outcome once it has ended).
* :class:`FailureClass`: why a failed run failed (``compaction_runs.failure_class``).
* :class:`ModelFailure`: why one summarizer call failed (``worker.llm.errors``).
* :class:`RunCause`: what started a run (``compaction_runs.trigger``, the Celery queue it takes).
* :class:`SignalReason`: why a runtime signalled pressure.
* :class:`Stage`: the steps a run took (``Outcome.stages``, the tokens-saved metric's label).
* :class:`JobState` and :class:`ItemState`: a bulk job's and its items' ``state``.
* :class:`LayoutRole`: the part a checkpoint plays in the ``recallable`` layout
  (``meta.recall.layout``).
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class NodeKind(StrEnum):
    MESSAGE = "message"  # appended by the runtime
    CHECKPOINT = "checkpoint"  # a summary replacing a contiguous run of nodes
    PRUNED = "pruned"  # a tool result (or call) with its bulk cleared


@unique
class JournalKind(StrEnum):
    START = "compaction/start"  # written first, in the claim's transaction
    PRUNE = "compaction/prune"  # before each pruned node
    SUMMARY = "compaction/summary"  # before each checkpoint
    END = "compaction/end"  # written last


# The node kinds that replace nodes already on the surface.
REPLACE_KINDS = (NodeKind.CHECKPOINT, NodeKind.PRUNED)
EVENT_KINDS = frozenset(NodeKind) | frozenset(JournalKind)


@unique
class RunStatus(StrEnum):
    RUNNING = "running"
    COMMITTED = "committed"
    NOTHING_TO_DO = "nothing_to_do"
    FAILED = "failed"
    # Committed some of its steps (prunes, an earlier round's checkpoint), then failed: the
    # session did shrink; its failure class says why the rest did not happen.
    PARTIAL = "partial"


@unique
class FailureClass(StrEnum):
    BUSY = "busy"  # another run holds the lease
    CANCELLED = "cancelled"  # the deadline, a shutdown or a revoked task ended it
    CHANGED = "changed"  # the surface moved under the plan
    SUMMARY = "summary"  # every summarizer candidate failed
    COMMIT = "commit"  # writing the result failed
    PERSISTENCE = "persistence"  # a storage error before anything was committed
    ABANDONED = "abandoned"  # the lease was lost, expired or released


@unique
class ModelFailure(StrEnum):
    AUTH = "auth"  # 401/403: the key is wrong, expired or lacks the scope
    NOT_FOUND = "not_found"  # 404: the model or endpoint does not exist
    BAD_REQUEST = "bad_request"  # any other 4xx: the request itself is wrong
    QUOTA = "quota"  # 429 that says the spend limit or quota is used up: not transient
    RATE_LIMITED = "rate_limited"  # 429: transient, honour Retry-After
    SERVER = "server"  # 5xx, 529 overloaded, 409: transient
    TIMEOUT = "timeout"  # the request or the candidate's time budget ran out
    CONNECTION = "connection"  # connect/read failure below HTTP: transient
    CONTEXT_LENGTH = "context_length"  # the input is larger than the model's window
    MALFORMED = "malformed"  # a 2xx whose body is not the wire format
    NON_TEXT = "non_text"  # no text: tool calls only, reasoning only, or an image/audio part
    EMPTY = "empty"  # text that is empty or whitespace only
    TRUNCATED = "truncated"  # the output stopped at its token cap
    REFUSED = "refused"  # the policy's validation refused the text (e.g. it does not shrink)
    UNAVAILABLE = "unavailable"  # the client cannot be built, or is remembered so
    DEADLINE = "deadline"  # the overall deadline ended this candidate or came before it
    CIRCUIT_OPEN = "circuit_open"  # skipped: its recent calls kept failing (worker.breaker)
    INTERNAL = "internal"  # an unexpected exception in compactd's adapter code


@unique
class RunCause(StrEnum):
    PRESSURE = "pressure"  # a runtime's signal or append crossed the trigger
    SWEEP = "sweep"  # the periodic sweep found the session over its trigger
    REAP = "reap"  # the reaper closed an expired lease on a session still over it
    MANUAL = "manual"  # an operator or the API asked for a run
    OVERFLOW = "overflow"  # the runtime's context overflowed: it waits for the run
    WINDOW = "window"  # the runtime moved to a run model whose window the session overflows
    BULK = "bulk"  # an item of a bulk recompaction job



@unique
class SignalReason(StrEnum):
    PRESSURE = "pressure"
    STEP = "step"
    APPEND = "append"


@unique
class LeadBy(StrEnum):
    """Which part of a session's lead is the larger (``worker.pressure.lead_parts``)."""

    GROWTH = "growth"  # its growth rate over the lead's seconds
    STEP = "step"  # its largest recent step (summarization.lead_steps)


@unique
class Stage(StrEnum):
    PRUNE = "prune"
    SUMMARY = "summary"


@unique
class JobState(StrEnum):
    RUNNING = "running"
    DONE = "done"


@unique
class ItemState(StrEnum):
    PENDING = "pending"
    ENQUEUED = "enqueued"
    DONE = "done"
    SKIPPED = "skipped"  # its run had nothing to do (under its trigger): nothing compacted
    FAILED = "failed"


@unique
class LayoutRole(StrEnum):
    INDEX = "index"  # a frozen chunk checkpoint: never rewritten, never summarized again
    STATE = "state"  # the working memory, rewritten by every pass
