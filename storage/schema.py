"""Tables. The Alembic migrations in ``storage/migrations`` create exactly these (a test runs
``alembic check`` to prove there is no drift)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from compactd.storage.records import YOUNG_GROWTH_MAX_FACTOR, RunRecord, SessionInfo

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


def dumps(value: Any) -> str:
    # Compact, and non-ASCII kept as is: tool results are often large and not English.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class UTCDateTime(sa.types.TypeDecorator[dt.datetime]):
    """Aware UTC datetimes on every backend.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, and its dialect's DATETIME
    writes the UTC value's fields without the zone: values are stored as naive UTC there and
    made aware again on the way out. Comparisons in SQL see the same representation on both.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime passed to storage; use aware UTC")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect
                             ) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


JSONText = sa.JSON(none_as_null=True)

# Whether a session may be over its trigger, from its columns alone (the pressure of
# ``worker.pressure.session_pressure``); NULL thresholds never match. Thresholds on the left:
# SQLite turns ``expr >= column`` around when it matches a query to an index. The report's
# growth is never negative (``SessionInfo.reported_tokens``): both of its cases are listed
# instead of a GREATEST the two backends spell differently. Each token measure counts the
# growth the session's lead stands for (``summarization.lead``), at the most a young session's
# rate is scaled by (``records.unbiased_growth_rate``): the flag then holds every session that
# fires early, and ``worker.pressure`` narrows it.
_LEAD_GROWTH = f"growth_rate * lead_s * {YOUNG_GROWTH_MAX_FACTOR}"
OVER_SWEEP_SQL = (
    f"sweep_tokens <= surface_tokens + envelope_tokens + {_LEAD_GROWTH}"
    f" OR sweep_tokens <= reported_input_tokens + reported_output_tokens + {_LEAD_GROWTH}"
    " OR sweep_tokens <= reported_input_tokens + reported_output_tokens + surface_tokens"
    f" + envelope_tokens - reported_base_tokens + {_LEAD_GROWTH}"
    " OR sweep_messages <= surface_messages")

sessions = sa.Table(
    "sessions", metadata,
    sa.Column("id", sa.String(255), primary_key=True),
    sa.Column("tenant", sa.String(255), nullable=False),
    sa.Column("run_model", sa.String(255), nullable=True),
    sa.Column("context_window", sa.Integer, nullable=True),
    # The runtime's system prompt and tool schemas: sent with every call, so they count toward
    # pressure, but they are not part of the surface.
    sa.Column("envelope", JSONText, nullable=True),
    sa.Column("envelope_tokens", sa.Integer, nullable=False),
    sa.Column("policy", JSONText, nullable=True),
    sa.Column("surface_version", sa.BigInteger, nullable=False),
    sa.Column("surface_tokens", sa.BigInteger, nullable=False),
    sa.Column("surface_messages", sa.Integer, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("last_position", sa.BigInteger, nullable=False),
    # The provider's own input_tokens for the runtime's last call, and the surface version it
    # was measured on; stale once a compaction replaced part of that surface.
    sa.Column("reported_input_tokens", sa.Integer, nullable=True),
    sa.Column("reported_version", sa.BigInteger, nullable=True),
    # The same call's output tokens (the next request holds the response too), and the surface
    # plus envelope tokens when it was reported: what was appended since is counted on top.
    sa.Column("reported_output_tokens", sa.Integer, nullable=True),
    sa.Column("reported_base_tokens", sa.BigInteger, nullable=True),
    # Signal de-duplication: when the pending task was enqueued (cleared when its run ends). A
    # signal enqueues only when no mark is younger than the signal TTL; the sweep passes over a
    # session only while its mark is younger than one sweep interval, so a lost message delays
    # compaction by at most two intervals.
    sa.Column("signal_at", UTCDateTime, nullable=True),
    sa.Column("lease_owner", sa.String(255), nullable=True),
    sa.Column("lease_run_id", sa.String(36), nullable=True),
    sa.Column("lease_expires_at", UTCDateTime, nullable=True),
    sa.Column("lease_fence", sa.BigInteger, nullable=False),
    # Loop guard: compactions that brought no relief, and the cool-down they earned.
    sa.Column("cooldown_until", UTCDateTime, nullable=True),
    sa.Column("flagged_reason", sa.Text, nullable=True),
    sa.Column("flagged_at", UTCDateTime, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("last_append_at", UTCDateTime, nullable=True),
    # Tokens per second the appends added, weighted toward the last GROWTH_WINDOW_S
    # (storage.records): what a session's runway is measured with. Kept by the append itself.
    sa.Column("growth_rate", sa.Float, nullable=False, server_default=sa.text("0")),
    # The pressure sweep's thresholds, so it decides in SQL on an index instead of reading every
    # row: the lowest pressure (tokens) and the lowest message count at which the session's
    # trigger can fire, resolved from its policy and window by the sweep under the
    # configuration named by ``sweep_key`` (NULL: not resolved yet, or its policy changed).
    sa.Column("sweep_key", sa.String(32), nullable=True),
    sa.Column("sweep_tokens", sa.BigInteger, nullable=True),
    sa.Column("sweep_messages", sa.Integer, nullable=True),
    # Whether the cached totals reach those thresholds, computed by the database on every
    # write of the row. A partial index on the derived flag rather than on the totals
    # themselves: an append changes the totals but rarely the flag, so on PostgreSQL it stays
    # a heap-only (HOT) update that touches no index.
    sa.Column("over_sweep", sa.Boolean, sa.Computed(OVER_SWEEP_SQL, persisted=True)),
    # The surface version the last commit that replaced part of the surface produced (NULL:
    # none yet). A usage report built on an older version describes a request the compaction
    # has since shrunk; one built on this version or later, with plain appends since, does not.
    sa.Column("compacted_version", sa.BigInteger, nullable=True),
    # The lead of the session's pool (``checkpoint_leads``) as its last append read it: the
    # seconds from a signal to the checkpoint it asks for, which its growth is counted over.
    sa.Column("lead_s", sa.Float, nullable=False, server_default=sa.text("0")),
    # The largest recent append's tokens, decayed by each append (``records.STEP_DECAY``; 0
    # until the second append): the lead counts one such step (``worker.pressure``).
    sa.Column("step_tokens", sa.Float, nullable=False, server_default=sa.text("0")),
    # The surface and envelope tokens the last commit that replaced part of the surface left
    # (NULL: none yet): the lead fires a session early by at most what it grew since.
    sa.Column("compacted_tokens", sa.BigInteger, nullable=True),
    # A run that could not bring the session under its trigger: the pressure below which it
    # does not fire again (``worker.compaction.refire``), while ``compacted_version`` is still
    # the one that run saw (``refire_version``; a replacing commit since makes the mark stale).
    sa.Column("refire_tokens", sa.BigInteger, nullable=True),
    sa.Column("refire_version", sa.BigInteger, nullable=True),
    # The counters kept by name (``storage.counters``; NULL: none counted), their floors for
    # the sweep (NULL: none), and whether some count reaches its floor: kept by every write of
    # either (the append, the commit, the sweep's resolve) since a generated column cannot
    # read JSON by names it does not know.
    sa.Column("counts", JSONText, nullable=True),
    sa.Column("sweep_counts", JSONText, nullable=True),
    sa.Column("over_counts", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Index(None, "tenant"),
    sa.Index(None, "lease_expires_at"),
    sa.Index(None, "sweep_key"),
)


# The index the sweep reads: the sessions whose stored column ``over_sweep`` is true.
OVER_SWEEP_THRESHOLD = sessions.c.over_sweep == sa.true()
sa.Index("ix_sessions_over_trigger", sessions.c.id, postgresql_where=OVER_SWEEP_THRESHOLD,
         sqlite_where=OVER_SWEEP_THRESHOLD)
# And the sessions whose counters kept by name reach their floors.
OVER_COUNTS = sessions.c.over_counts == sa.true()
sa.Index("ix_sessions_over_counts", sessions.c.id, postgresql_where=OVER_COUNTS,
         sqlite_where=OVER_COUNTS)
# What the sweep selects: either flag.
OVER_SWEEP_FLOORS = sa.or_(OVER_SWEEP_THRESHOLD, OVER_COUNTS)

events = sa.Table(
    "events", metadata,
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("payload", JSONText, nullable=False),
    sa.Column("tokens", sa.Integer, nullable=True),
    sa.Column("run_id", sa.String(36), nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

surface = sa.Table(
    "surface", metadata,
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("position", sa.BigInteger, primary_key=True),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("tokens", sa.Integer, nullable=False),
    # What the node adds to each counter kept by name (``storage.counters``; NULL: nothing).
    sa.Column("counts", JSONText, nullable=True),
    sa.UniqueConstraint("session_id", "seq"),
)

tool_calls = sa.Table(
    "tool_calls", metadata,
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              primary_key=True),
    # An id may be issued again once its earlier call is answered, so the call's seq is part of
    # the key; at most one row per id is open (result_seq NULL), which append enforces.
    sa.Column("call_id", sa.String(255), primary_key=True),
    sa.Column("call_seq", sa.BigInteger, primary_key=True),
    sa.Column("result_seq", sa.BigInteger, nullable=True),
)

compaction_runs = sa.Table(
    "compaction_runs", metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              nullable=False),
    sa.Column("trigger", sa.String(32), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("failure_class", sa.String(32), nullable=True),
    sa.Column("owner", sa.String(255), nullable=True),
    sa.Column("fence", sa.BigInteger, nullable=True),
    sa.Column("task_id", sa.String(255), nullable=True),
    sa.Column("bulk_job_id", sa.String(36), nullable=True),
    sa.Column("surface_version_at_start", sa.BigInteger, nullable=True),
    sa.Column("range_seqs", JSONText, nullable=True),
    sa.Column("candidates", JSONText, nullable=True),
    sa.Column("stages", JSONText, nullable=True),
    sa.Column("model", sa.String(255), nullable=True),
    sa.Column("usage", JSONText, nullable=True),
    sa.Column("tokens_before", sa.Integer, nullable=True),
    sa.Column("tokens_after", sa.Integer, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("started_at", UTCDateTime, nullable=False),
    sa.Column("heartbeat_at", UTCDateTime, nullable=True),
    sa.Column("finished_at", UTCDateTime, nullable=True),
    # When the pressure signal that asked for an automatic run was marked: a committed
    # checkpoint's ``finished_at`` less this is what the lead is measured from.
    sa.Column("signalled_at", UTCDateTime, nullable=True),
    # What a manual run was asked to focus on (``compact --instructions``, an agent's
    # ``compact_context``), every distinct text of the requests it stands for (migration 0020).
    sa.Column("instructions", JSONText, nullable=True),
    sa.Index(None, "session_id", "started_at"),
    sa.Index(None, "status", "started_at"),
    sa.Index(None, "task_id"),
    sa.Index(None, "bulk_job_id"),
)

bulk_jobs = sa.Table(
    "bulk_jobs", metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("filter", JSONText, nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("force", sa.Boolean, nullable=False),
    sa.Column("rate_per_s", sa.Float, nullable=True),
    sa.Column("matched", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

bulk_items = sa.Table(
    "bulk_items", metadata,
    sa.Column("job_id", sa.String(36), sa.ForeignKey("bulk_jobs.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("session_id", sa.String(255), primary_key=True),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("run_id", sa.String(36), nullable=True),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    sa.Index(None, "job_id", "state"),
)

# The lead each summary pool fires by (migration 0016): ``pool`` is a run model's name (its
# sessions share a candidate chain), ``*`` every run, ``""`` sessions without a run model. Written
# by the beat sweep and by workers after their commits (``worker.lead``), read by the append
# with a primary-key lookup; ``source`` says where ``lead_s`` came from (auto, configured, off).
checkpoint_leads = sa.Table(
    "checkpoint_leads", metadata,
    sa.Column("pool", sa.String(255), primary_key=True),
    sa.Column("lead_s", sa.Float, nullable=False),
    sa.Column("source", sa.String(16), nullable=False),
    sa.Column("runs", sa.Integer, nullable=False),
    sa.Column("p90_s", sa.Float, nullable=True),
    sa.Column("measured_at", UTCDateTime, nullable=False),
)

# Manual-run de-duplication: the task of the manual compaction queued for a session and not yet
# started (its worker deletes the row when the run starts). While a row is younger than the
# signal TTL, another manual request gets its task id instead of a second task; an older row
# (a lost message) is taken over.
manual_requests = sa.Table(
    "manual_requests", metadata,
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("task_id", sa.String(64), nullable=False),
    sa.Column("queued_at", UTCDateTime, nullable=False),
    # The distinct instructions of the requests the queued task stands for, in their order
    # (migration 0020): a request coalesced into the task adds its own; the run, once it holds
    # the lease, moves them onto its run row as it deletes this one (store.take_manual), so
    # a delivery that dies before that leaves them here. A row whose task_id is empty
    # (store.KEPT_TASK_ID) holds the instructions of a run that ended busy, or before it took
    # them, for the next request to take over.
    sa.Column("instructions", JSONText, nullable=True),
)

# Recall (migration 0010): what compaction replaced, kept searchable. Recorded by the commit of
# every replace event (a checkpoint or a pruned node) and indexed after it (migration 0014),
# never by the append path, so only what was replaced is indexed and an append costs nothing
# more.
#
# One row per replace node: the name its footer gives it (``c12-340``, ``r57``), the span of
# original seqs it stands for, and how many originals (and their bytes) it was the first to
# replace: a search's "scanned" sums these over the nodes inside its span instead of reading
# every original.
recall_nodes = sa.Table(
    "recall_nodes", metadata,
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True),
    sa.Column("ref", sa.String(64), nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("messages", sa.Integer, nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Index("ix_recall_nodes_ref", "session_id", "ref"),
)

# One row per original message a replace took off the surface: the node that first replaced
# it, and its searchable text (content, text blocks, tool calls' names and arguments, bounded:
# storage.recall_index), NULL until it is indexed after the commit (migration 0014). The text
# indexes are not declared here (``UNMANAGED_SCHEMA``): PostgreSQL's is a trigram GIN index on
# this column (its full-text one went in migration 0015), SQLite's an FTS5 table beside it; nor
# is the partial index of the pending rows.
recall_originals = sa.Table(
    "recall_originals", metadata,
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True),
    sa.Column("node_seq", sa.BigInteger, nullable=False),
    sa.Column("body", sa.Text, nullable=True),
    sa.Column("bytes", sa.Integer, nullable=False),
)

# Idempotent appends (migration 0021): one row per append made with a client's key, holding
# what that append returned. An append made again with the key (a runtime retrying one whose
# answer it never got) is answered from this row and stores nothing; the row counts only while
# it is younger than ``retention.append_keys_hours`` (an older one is taken over by the next
# append with its key, and retention's purge deletes it). ``request_sha256`` is the digest of
# the batch, so the key reused with another batch is refused instead of answered wrongly.
append_keys = sa.Table(
    "append_keys", metadata,
    sa.Column("session_id", sa.String(255), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("request_sha256", sa.String(64), nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("surface_version", sa.BigInteger, nullable=False),
    sa.Column("surface_tokens", sa.BigInteger, nullable=False),
    sa.Column("surface_messages", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Index(None, "created_at"),
)

# The last run of each beat task that records itself (migration 0018): retention's purge, so
# `compactd status` can say when it last ran and what it removed.
beat_runs = sa.Table(
    "beat_runs", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("finished_at", UTCDateTime, nullable=False),
    sa.Column("result", JSONText, nullable=True),
)

# Objects migrations create that the models cannot describe (an FTS5 table and its shadow
# tables, a GIN index with an operator class, a partial index): ``alembic check`` leaves them be.
UNMANAGED_SCHEMA = ("recall_fts", "ix_recall_originals_trgm", "ix_recall_originals_pending")


def unmanaged(name: str | None) -> bool:
    return name is not None and name.startswith(UNMANAGED_SCHEMA)


SESSION_COLUMNS = list(sessions.c)
RUN_COLUMNS = list(compaction_runs.c)


def session_from_record(record: Any) -> SessionInfo:
    """A session from a raw asyncpg record of a pool connection (JSON arrives decoded: the
    dialect installs asyncpg's json and jsonb codecs on every connection it opens)."""
    return SessionInfo(**_record_values(record, SESSION_COLUMNS))


def run_from_record(record: Any) -> RunRecord:
    """A run from a raw asyncpg record of a pool connection (JSON decoded, as above)."""
    return RunRecord(**_record_values(record, RUN_COLUMNS))


def _record_values(record: Any, columns: list[sa.Column[Any]]) -> dict[str, Any]:
    return {c.name: record[c.name] for c in columns}


def session_from_row(row: Any) -> SessionInfo:
    return SessionInfo(**_record_values(row._mapping, SESSION_COLUMNS))


def run_from_row(row: Any) -> RunRecord:
    return RunRecord(**_record_values(row._mapping, RUN_COLUMNS))
