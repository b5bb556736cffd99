"""Recall over the log: ``history_search`` and ``history_read`` over the originals of everything a
checkpoint or a prune replaced (migration 0010 indexes them as each replace commits).

Names are the footers' (``c12-340``, ``r57``, :mod:`worker.compaction.recall`); storage only
looks them up, so an unknown, malformed or another session's name is the same
:class:`RecallNotFound`. A hit names the node that first replaced its message, which stays
readable after a later merge replaced that node in turn.

``history_read`` renders a node's originals as a transcript, each message's content verbatim,
paginated by a token budget: a page holds whole messages while they fit, and a message larger
than the budget is cut across pages by code point. The cursor a page returns encodes the node's
name, the message index and the code point to resume at; a cursor is refused for another node.

Reads only: a refused argument (:class:`RecallArgumentError`) is raised before any statement.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage.connectors import Connector
from compactd.storage.database import snapshot
from compactd.storage.errors import RecallArgumentError, RecallNotFound, SessionNotFound
from compactd.storage.recall_bounds import (
    DEFAULT_READ_TOKENS,
    DEFAULT_SEARCH_LIMIT,
    check_budget_tokens,
    check_cursor,
    check_limit,
    check_offset,
    check_query,
)
from compactd.storage.recall_index import PENDING_SCANNED, json_escaped, json_fragment_text
from compactd.storage.recall_text import (
    SNIPPET_BEFORE_CHARS,
    SNIPPET_CHARS,
    Candidate,
    fold,
    rank,
    ranked_words,
)
from compactd.storage.tokens import TokenCounter, counter_for, fitting_prefix

# The ranked stage looks at the newest this many originals holding each of the query's words
# (not the newest holding any): a message holding every rare word is a candidate however many
# newer ones hold a common word, and a word held by most of a session costs a bounded walk.
RANKED_CANDIDATES_PER_WORD = 200
_READ_BATCH = 64  # originals fetched per statement while a page fills
_CURSOR_PREFIX = "hr1."
_NO_SPAN = (0, 2**63 - 1)


@dataclass(frozen=True, slots=True)
class SearchHit:
    checkpoint: str  # the node that replaced the message (history_read's argument)
    seq: int  # the original message's seq
    snippet: str
    exact: bool  # the query is a substring of the message (case-insensitive)

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "seq": self.seq, "snippet": self.snippet,
                "exact": self.exact}


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: tuple[SearchHit, ...]
    scanned_messages: int
    scanned_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"hits": [h.to_json() for h in self.hits],
                "scanned": {"messages": self.scanned_messages, "bytes": self.scanned_bytes}}


@dataclass(frozen=True, slots=True)
class ReadPage:
    checkpoint: str
    transcript: str
    seqs: tuple[int, ...]  # the originals this page shows (wholly or in part)
    offset: int  # the index of the first of them among the node's originals
    # The first message this page did not begin (past a message it cut; None: none is left);
    # the cursor resumes inside a cut one.
    next_offset: int | None
    cursor: str | None  # the same, to the code point (None: this was the last)
    total_messages: int
    tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "transcript": self.transcript,
                "seqs": list(self.seqs), "offset": self.offset,
                "next_offset": self.next_offset, "cursor": self.cursor,
                "total_messages": self.total_messages, "tokens": self.tokens}


def encode_cursor(ref: str, index: int, char: int) -> str:
    raw = f"{ref}:{index}:{char}".encode()
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, ref: str, argument: str = "offset") -> tuple[int, int]:
    """(message index, code point) of a cursor :meth:`RecallMixin.history_read` returned for
    ``ref``; anything else is refused, naming ``argument`` (what the caller passed it as)."""
    try:
        if not cursor.startswith(_CURSOR_PREFIX):
            raise ValueError
        body = cursor[len(_CURSOR_PREFIX):]
        text = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()
        named, index, char = text.rsplit(":", 2)
        at, within = int(index), int(char)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise RecallArgumentError(argument, "is neither an integer nor a cursor history_read "
                                            "returned") from None
    if named != ref:
        raise RecallArgumentError(argument, f"the cursor belongs to {named!r}, not {ref!r}")
    if within < 0:
        raise RecallArgumentError(argument, "the cursor is damaged")
    try:
        return check_offset(at), within
    except RecallArgumentError as exc:
        raise RecallArgumentError(argument, exc.reason) from None


def render_original(seq: int, payload: Mapping[str, Any]) -> str:
    """One original as the transcript shows it: a header line, then its content verbatim (a
    list of blocks as its JSON), then one line per tool call with its arguments verbatim."""
    role = str(payload.get("role", "?"))
    header = f"[seq {seq} {role}"
    if payload.get("tool_call_id") is not None:
        header += f" tool_call_id={payload['tool_call_id']}"
    if payload.get("name") is not None:
        header += f" name={payload['name']}"
    lines = [header + "]"]
    content = payload.get("content")
    if isinstance(content, str):
        lines.append(content)
    elif content is not None:
        lines.append(json.dumps(content, ensure_ascii=False))
    for call in payload.get("tool_calls") or ():
        call_id, name, arguments = call
        lines.append(f"-> call {call_id} {name} {arguments}")
    return "\n".join(lines) + "\n\n"


def _like_pattern(query: str) -> str:
    escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _fts_phrase(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


class RecallMixin:
    """``history_search`` and ``history_read`` for :class:`storage.store.Store`."""

    engine: AsyncEngine
    db: Connector

    async def history_search(self, session_id: str, query: str, checkpoint: str | None = None,
                             limit: int = DEFAULT_SEARCH_LIMIT, *, tenant: str | None = None
                             ) -> SearchResult:
        """Messages compaction replaced in this session that hold ``query`` (exact, case-
        insensitive substring; newest first), then those holding its words, ranked by
        :func:`storage.recall_text.rank` (most words held first); at most ``limit``."""
        check_query(query)
        check_limit(limit)
        db = self.db
        async with snapshot(self.engine) as conn:
            await _session(db, conn, session_id, tenant)
            first, last = _NO_SPAN
            if checkpoint is not None:
                _, first, last = await _node(db, conn, session_id, checkpoint)
            span = {"session_id": session_id, "first_seq": first, "last_seq": last}
            await db.plan_for_each_search(conn)
            scanned = await db.fetchrow("history_scanned", conn=conn, **span)
            assert scanned is not None  # an aggregate has a row
            around = {"before": SNIPPET_BEFORE_CHARS, "width": SNIPPET_CHARS}
            # Each backend's form takes the parameters it names: a LIKE pattern (PostgreSQL's
            # trigram index) or an FTS5 phrase (SQLite's).
            rows = await db.search_exact(conn, **span, **around, query=query, limit=limit,
                                         pattern=_like_pattern(query),
                                         phrase=_fts_phrase(query),
                                         needles=json.dumps([fold(query)]))
            hits = [SearchHit(r["ref"], r["seq"], r["snippet"], True) for r in rows]
            # Originals the index has not taken yet (storage.recall_index) are scanned as
            # appended, and their hits join the exact ones, newest first.
            escaped = json_escaped(query)
            pending = await db.search_pending(conn, **span, escaped=escaped,
                                              pattern=_like_pattern(escaped),
                                              before=SNIPPET_BEFORE_CHARS, width=SNIPPET_CHARS,
                                              scan=PENDING_SCANNED, limit=limit)
            if pending:
                hits = sorted(hits + [SearchHit(r["ref"], r["seq"],
                                                json_fragment_text(r["snippet"]), True)
                                      for r in pending],
                              key=lambda h: h.seq, reverse=True)[:limit]
            words = ranked_words(query)
            if len(hits) < limit and words:
                ranked = await _ranked(db, conn, span, query, words, int(scanned["messages"]))
                hits += [SearchHit(ref, seq, text, False)
                         for seq, ref, text in ranked[:limit - len(hits)]]
        return SearchResult(tuple(hits), int(scanned["messages"]), int(scanned["bytes"]))

    async def history_read(self, session_id: str, checkpoint: str, offset: int | str = 0, *,
                           cursor: str | None = None, budget_tokens: int = DEFAULT_READ_TOKENS,
                           tenant: str | None = None) -> ReadPage:
        """A page of the originals ``checkpoint`` (a checkpoint's or a pruned result's name)
        replaced, from ``offset`` (a message index, or a cursor a previous page returned) or
        from ``cursor`` (a refused one is named ``cursor``)."""
        if not isinstance(checkpoint, str) or not checkpoint.strip():
            raise RecallArgumentError("checkpoint", "is required")
        ref = checkpoint.strip()
        if cursor is not None:
            if offset != 0:
                raise RecallArgumentError("cursor", "give offset or cursor, not both")
            source = "cursor"
            index, char = decode_cursor(check_cursor(cursor), ref, "cursor")
        elif isinstance(offset, str):
            source = "offset"
            index, char = decode_cursor(offset, ref)
        elif isinstance(offset, bool) or not isinstance(offset, int):
            raise RecallArgumentError("offset", f"must be an integer or a cursor, got "
                                                f"{type(offset).__name__}")
        else:
            source = None
            index, char = check_offset(offset), 0
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int):
            raise RecallArgumentError("budget_tokens", f"must be an integer, got "
                                                       f"{type(budget_tokens).__name__}")
        check_budget_tokens(budget_tokens)
        db = self.db
        async with snapshot(self.engine) as conn:
            run_model = await _session(db, conn, session_id, tenant)
            _, first, last = await _node(db, conn, session_id, ref)
            span = {"session_id": session_id, "first_seq": first, "last_seq": last}
            total = int(await db.fetchval("history_count", conn=conn, **span) or 0)
            if source is not None and index >= total:
                raise RecallArgumentError(source, f"the cursor points past the last of the "
                                                  f"{total} messages {ref} replaced")
            page = _Page(counter_for(run_model), budget_tokens, index, char, source)
            while not page.done and page.at < total:
                rows = await db.fetch("history_originals", conn=conn, **span,
                                      limit=_READ_BATCH, offset=page.at)
                if not rows:
                    break
                # Rendering and counting a large original takes the CPU for as long as its
                # size: off the event loop, which answers every other request meanwhile.
                await asyncio.to_thread(page.fill, rows)
        at, within = page.at, page.within
        more = at < total
        # An offset names a whole message: past one this page cut, the next not begun, so a
        # client paging by offset always moves on (the cursor resumes inside the cut one).
        after = at + 1 if within else at
        return ReadPage(checkpoint=ref, transcript="".join(page.parts), seqs=tuple(page.seqs),
                        offset=index, next_offset=after if after < total else None,
                        cursor=encode_cursor(ref, at, within) if more else None,
                        total_messages=total, tokens=page.used)


class _Page:
    """A read page as it fills: whole originals while they fit, then as much of one too large
    for what is left as fits (:meth:`fill`, one batch of originals at a time)."""

    def __init__(self, counter: TokenCounter, budget: int, at: int, within: int,
                 source: str | None) -> None:
        self.counter, self.budget = counter, budget
        self.at, self.within = at, within
        self.source = source  # the argument that gave a position inside a message
        self.parts: list[str] = []
        self.seqs: list[int] = []
        self.used = 0
        self.done = False

    def fill(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            rendered = render_original(row["seq"], _payload(row["payload"]))
            if self.within and self.within >= len(rendered):
                raise RecallArgumentError(self.source or "offset", (
                    f"the cursor points past the end of message seq {row['seq']} "
                    f"({len(rendered)} code points)"))
            block = rendered[self.within:]
            room = self.budget - self.used
            fits, tokens = _fitting(block, room, self.counter)
            if fits == len(block):
                self.parts.append(block)
                self.seqs.append(row["seq"])
                self.used += tokens
                self.at, self.within = self.at + 1, 0
                continue
            if not self.parts or self.used < self.budget // 2:
                # Too large for what is left: as much as fits, the rest next page.
                cut = max(fits, 1)
                self.parts.append(block[:cut])
                self.seqs.append(row["seq"])
                self.used += tokens if cut == fits else self.counter.count_text(block[:cut])
                self.within += cut
            self.done = True
            return


# How many code points per token the first look at a block assumes; a block that fits in fewer
# tokens than that many code points allow is looked at again, four times as long.
_PROBE_CHARS_PER_TOKEN = 8


def _fitting(block: str, room: int, counter: TokenCounter) -> tuple[int, int]:
    """(code points, tokens) of the longest prefix of ``block`` within ``room`` tokens: all of
    it when it fits. Counts no more of the block than about ``room`` tokens' worth, however long
    the block (a 3 MB line counted whole on every page made reading it quadratic)."""
    probe = max(room, 1) * _PROBE_CHARS_PER_TOKEN
    while probe < len(block):
        if counter.count_text(block[:probe]) > room:
            block = block[:probe]
            break
        probe *= 4
    else:
        tokens = counter.count_text(block)
        if tokens <= room:
            return len(block), tokens
    fits = fitting_prefix(block, room, counter) if room > 0 else 0
    return fits, counter.count_text(block[:fits])


async def _ranked(db: Connector, conn: AsyncConnection, span: dict[str, Any], query: str,
                  words: list[str], messages: int) -> list[tuple[int, str, str]]:
    """(seq, node, snippet) of the originals holding any of ``words`` but not the whole query,
    best first: each word's newest holders are the candidates, the database says which words
    each holds, and :func:`rank` orders them (the same integers, so the same order, on both
    backends)."""
    seqs: set[int] = set()
    for word in words:
        rows = await db.search_word(conn, **span, word=word, pattern=_like_pattern(word),
                                    phrase=_fts_phrase(word), cap=RANKED_CANDIDATES_PER_WORD)
        seqs.update(int(r["seq"]) for r in rows)
    if not seqs:
        return []
    ordered = sorted(seqs)
    rows = await db.search_held(conn, session_id=span["session_id"], query=query,
                                seq_list=ordered, seqs=json.dumps(ordered),
                                word_list=words, words=json.dumps(words),
                                before=SNIPPET_BEFORE_CHARS, width=SNIPPET_CHARS)
    found = {int(r["seq"]): (str(r["ref"]), str(r["snippet"])) for r in rows}
    best = rank((Candidate(int(r["seq"]), int(r["held"])) for r in rows), words, messages)
    return [(seq, *found[seq]) for seq in best]


async def _session(db: Connector, conn: AsyncConnection, session_id: str,
                   tenant: str | None) -> str | None:
    """The session's run model; another tenant's session is not found, like a missing one."""
    row = await db.fetchrow("history_session", conn=conn, session_id=session_id)
    if row is None or (tenant is not None and row["tenant"] != tenant):
        raise SessionNotFound(session_id)
    run_model: str | None = row["run_model"]
    return run_model


async def _node(db: Connector, conn: AsyncConnection, session_id: str, ref: str
                ) -> tuple[int, int, int]:
    row = await db.fetchrow("history_node", conn=conn, session_id=session_id, ref=ref.strip())
    if row is None:
        raise RecallNotFound(session_id, ref)
    return int(row["seq"]), int(row["first_seq"]), int(row["last_seq"])


def _payload(raw: Any) -> dict[str, Any]:
    return json.loads(raw) if isinstance(raw, str | bytes) else dict(raw)
