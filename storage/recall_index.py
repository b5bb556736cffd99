"""Recall's index, built after the commit that replaced what it indexes.

A commit only records what each replace node replaced (``compactd_recall_index`` on
PostgreSQL, the recall trigger's steps on SQLite): the node's name and span, and its originals
as *pending* rows of ``recall_originals`` (``body`` NULL). No payload is read there, so no
content (a NUL, megabytes of distinct tokens) can make a commit fail, and no text index work
holds a session's row while appends wait for it.

:meth:`RecallIndexMixin.index_recall` fills the pending rows afterwards, in short transactions
of its own that never touch the session row: the worker calls it for its session right after
its run, and the beat sweep for whatever is left (a worker that died between its commit and
the indexing). Each original's searchable text (its content, text blocks, tool calls' names and
arguments) is bounded: a verbatim prefix, then the distinct words of the rest while they fit.
``history_read`` serves the byte-exact original from the log; the index only has to find it.
Until a row is indexed, ``history_search`` finds its original by a scan of the pending rows
(``storage.recall``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncEngine

from compactd.storage import sql
from compactd.storage.errors import (
    DatabaseUnavailable,
    DeadlinePassed,
    LockNotAvailable,
    StorageError,
)
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import META_RECALL

if TYPE_CHECKING:
    from compactd.storage.connectors import Connector

logger = logging.getLogger(__name__)

# The text one original contributes to the index, in UTF-8 bytes: the index's work (trigram
# entries, the FTS5 table) grows with it, and a search needs a bounded text, not the original
# (history_read serves that from the log).
MAX_INDEXED_BYTES = 256 * 1024
# Of which the verbatim prefix (substrings are found in it); the rest holds distinct words.
INDEXED_PREFIX_BYTES = 128 * 1024
# A longer whitespace-separated token of the rest is not a word anyone searches for.
MAX_WORD_CHARS = 128
# Pending originals read per statement (and written per transaction): fewer round trips per
# run; bodies are bounded, payloads are not.
INDEX_BATCH = 32
# Indexed text written per transaction, at most (one original's always fits): a transaction's
# text index entries go to the log at its commit, and the appends committing behind it wait.
WRITE_BYTES = 512 * 1024
# Sessions with pending originals one sweep looks at.
SWEEP_SESSIONS = 100
# The newest pending originals a search scans (in the span it covers): pending is the moment
# between a commit and the indexing after it, or, with no worker indexing, until the sweep.
PENDING_SCANNED = 32
_ESCAPE = re.compile(r'\\(u[0-9a-fA-F]{4}|["\\/bfnrt])')
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                   "t": "\t"}


@dataclass(frozen=True, slots=True)
class NodeRecall:
    """A replace node's recall name and span as its ``meta.recall`` states them (None: not
    stated; the commit then names it from the span it replaced)."""

    ref: str | None
    first: int | None
    last: int | None


@dataclass(frozen=True, slots=True)
class RecallBody:
    """An original's indexed text, and the node it belongs to (whose bytes it adds to)."""

    seq: int
    node_seq: int
    bytes: int
    body: str


def sqlite_recall_triggers() -> tuple[str, ...]:
    """SQLite's recall triggers as storage/sql has them now: the events trigger records each
    replace node and its pending originals; the FTS5 table takes an original's text when it is
    indexed, and drops it with the original. (PostgreSQL's commit function records the node
    itself, and its GIN indexes keep themselves.)"""
    return (
        f"""CREATE TRIGGER compactd_recall AFTER INSERT ON events
        WHEN NEW.kind IN ('{NodeKind.CHECKPOINT.value}', '{NodeKind.PRUNED.value}') BEGIN
        {sql.as_trigger_body("recall_index_originals")};
        {sql.as_trigger_body("recall_index_node")};
        END""",
        f"""CREATE TRIGGER compactd_recall_fts AFTER UPDATE OF body ON recall_originals
        WHEN OLD.body IS NULL AND NEW.body IS NOT NULL BEGIN
        {sql.as_trigger_body("recall_fts_add")};
        END""",
        f"""CREATE TRIGGER compactd_recall_fts_delete AFTER DELETE ON recall_originals BEGIN
        {sql.as_trigger_body("recall_fts_drop", row="OLD")};
        END""",
    )


def node_recall(message: Mapping[str, Any]) -> NodeRecall:
    """What a node's message payload states about itself for recall: both ends of the span or
    neither."""
    meta = message.get("meta")
    recall = meta.get(META_RECALL) if isinstance(meta, Mapping) else None
    if not isinstance(recall, Mapping):
        return NodeRecall(None, None, None)
    ref = recall.get("ref")
    first, last = recall.get("first"), recall.get("last")
    span = (isinstance(first, int) and not isinstance(first, bool)
            and isinstance(last, int) and not isinstance(last, bool))
    return NodeRecall(ref if isinstance(ref, str) else None,
                      first if span else None, last if span else None)


def searchable_text(payload: Mapping[str, Any]) -> str:
    """An original's whole searchable text: its content (a string, or its text blocks one a
    line), then each tool call's name and arguments, one a line. A NUL becomes a space and a
    lone surrogate a question mark: a database text column takes neither."""
    parts: list[str] = []
    content = payload.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        texts = [b["text"] for b in content if isinstance(b, Mapping)
                 and b.get("type") == "text" and isinstance(b.get("text"), str)]
        if texts:
            parts.append("\n".join(texts))
    calls = payload.get("tool_calls")
    if isinstance(calls, list) and calls:
        parts.append("\n".join(_call_line(call) for call in calls))
    text = "\n".join(parts).replace("\x00", " ")
    return text.encode("utf-8", "replace").decode("utf-8")


def _call_line(call: Any) -> str:
    if isinstance(call, list | tuple) and len(call) >= 3:
        name, arguments = call[1], call[2]
        return " ".join(x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)
                        for x in (name, arguments) if x is not None)
    return json.dumps(call, ensure_ascii=False)


def indexed_text(text: str, limit: int = MAX_INDEXED_BYTES) -> str:
    """``text`` as the index holds it: whole when it fits ``limit`` bytes, else a verbatim
    prefix of half the limit and then the distinct words of the rest, in order, while they
    fit."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    prefix = raw[:limit // 2].decode("utf-8", "ignore")
    room = limit - len(prefix.encode("utf-8")) - 1
    words: dict[str, None] = {}
    for word in text[len(prefix):].split():
        if len(word) > MAX_WORD_CHARS or word in words:
            continue
        cost = len(word.encode("utf-8")) + 1
        if cost > room:
            break
        words[word] = None
        room -= cost
    return prefix + "\n" + " ".join(words)


@dataclass(frozen=True, slots=True)
class _Body:
    seq: int
    node_seq: int
    text: str  # the whole searchable text
    bytes: int  # its UTF-8 size (a search's "scanned" bytes)


class RecallIndexMixin:
    """``index_recall`` for :class:`storage.store.Store`."""

    engine: AsyncEngine
    db: Connector

    async def index_recall(self, session_id: str | None = None, *,
                           max_originals: int | None = None) -> int:
        """Index pending originals: ``session_id``'s, or (None) those of any session, at most
        ``max_originals`` (None: all). The originals indexed. Never takes a session's row."""
        if session_id is not None:
            return await self._index_session(session_id, max_originals)
        done = 0
        while max_originals is None or done < max_originals:
            sessions = [r["session_id"] for r in await self.db.fetch(
                "recall_pending_sessions", limit=SWEEP_SESSIONS)]
            if not sessions:
                break
            before = done
            for sid in sessions:
                left = None if max_originals is None else max_originals - done
                if left is not None and left <= 0:
                    break
                done += await self._index_session(sid, left)
            if done == before:
                break  # another indexer took them meanwhile
        return done

    async def _index_session(self, session_id: str, max_originals: int | None) -> int:
        done = 0
        while max_originals is None or done < max_originals:
            want = INDEX_BATCH if max_originals is None else min(INDEX_BATCH,
                                                                 max_originals - done)
            rows = await self.db.fetch("recall_pending_originals", session_id=session_id,
                                       limit=want)
            if not rows:
                break
            bodies = []
            for row in rows:
                text = searchable_text(_payload(row["payload"]))
                bodies.append(_Body(int(row["seq"]), int(row["node_seq"]), text,
                                    len(text.encode("utf-8"))))
            for chunk in _chunks(bodies):
                await self._write_bodies(session_id, chunk)
            done += len(rows)
            if len(rows) < want:
                break
        return done

    async def _write_bodies(self, session_id: str, bodies: Sequence[_Body]) -> None:
        try:
            await self._store_bodies(session_id, bodies, MAX_INDEXED_BYTES)
            return
        except (DatabaseUnavailable, LockNotAvailable, DeadlinePassed):
            raise
        except StorageError:
            if len(bodies) == 1 and not bodies[0].text:
                raise
        # One of them was refused (a text index's own limit): each alone, smaller until taken.
        for body in bodies:
            limit = MAX_INDEXED_BYTES
            while True:
                try:
                    await self._store_bodies(session_id, [body], limit)
                    break
                except (DatabaseUnavailable, LockNotAvailable, DeadlinePassed):
                    raise
                except StorageError as exc:
                    if limit == 0:
                        raise
                    limit = limit // 4 if limit > 1024 else 0
                    logger.warning("recall: an original's text was refused by the index; "
                                   "indexing less of it", extra={
                                       "action": "recall.index_shrunk", "session_id": session_id,
                                       "seq": body.seq, "limit_bytes": limit,
                                       "error": str(exc)})

    async def _store_bodies(self, session_id: str, bodies: Sequence[_Body], limit: int) -> None:
        """One short transaction: the texts, then the bytes of the nodes they belong to."""
        await self.db.write_recall_bodies(session_id, [
            RecallBody(b.seq, b.node_seq, b.bytes, indexed_text(b.text, limit)) for b in bodies])


def json_escaped(query: str) -> str:
    """``query`` as it appears inside a JSON string of the log (storage.schema.dumps)."""
    return json.dumps(query, ensure_ascii=False)[1:-1]


def json_fragment_text(fragment: str) -> str:
    """A cut of JSON text (a pending original's snippet) with its escapes decoded; an escape
    the cut split is dropped, and a NUL shows as a space, as the index holds it."""
    fragment = re.sub(r"\\u?[0-9a-fA-F]{0,3}$", "", fragment)

    def decode(match: re.Match[str]) -> str:
        code = match.group(1)
        if code.startswith("u"):
            char = chr(int(code[1:], 16))
            return " " if char == "\x00" else char
        return _SIMPLE_ESCAPES[code]

    text = _ESCAPE.sub(decode, fragment)
    return text.encode("utf-8", "replace").decode("utf-8")


def _chunks(bodies: Sequence[_Body]) -> list[list[_Body]]:
    """``bodies`` in runs of at most ``WRITE_BYTES`` of indexed text (one body at least)."""
    chunks: list[list[_Body]] = []
    size = WRITE_BYTES
    for body in bodies:
        cost = min(body.bytes, MAX_INDEXED_BYTES)
        if size + cost > WRITE_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(body)
        size += cost
    return chunks


def _payload(raw: Any) -> dict[str, Any]:
    value = json.loads(raw) if isinstance(raw, str | bytes) else raw
    return dict(value) if isinstance(value, Mapping) else {}
