"""Recall: search and read the originals compaction replaced (the client's
``history_search`` and ``history_read``), and the recall tools' schemas (``compactd tools``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from compactd.scheduler.http.auth import Tenant
from compactd.scheduler.http.routes.common import API_PREFIX, COMMON, RECALL, Owned
from compactd.scheduler.http.schemas import ReadOut, SearchOut, ToolsOut
from compactd.scheduler.http.state import ApiDep
from compactd.storage.errors import RecallArgumentError
from compactd.storage.recall_bounds import (
    DEFAULT_READ_TOKENS,
    DEFAULT_SEARCH_LIMIT,
    MAX_READ_TOKENS,
    MIN_READ_TOKENS,
)
from compactd.worker.compaction.recall_tools import tools_document

router = APIRouter(prefix=API_PREFIX, tags=["recall"])


@router.get("/sessions/{session_id}/history/search", response_model=SearchOut,
            operation_id="historySearch", responses=RECALL)
async def history_search(
        info: Owned, api: ApiDep,
        query: Annotated[str, Query(description="an error line, an id, a path, words")],
        checkpoint: Annotated[str | None, Query(
            description="search only what this checkpoint or pruned result replaced")]
        = None,
        limit: Annotated[int, Query(description="at most this many hits (1-100)")]
        = DEFAULT_SEARCH_LIMIT) -> dict[str, Any]:
    """The messages compaction replaced in this session that hold ``query`` (exact,
    case-insensitive substring; newest first), then those holding its words (most of them
    first)."""
    # The client refuses a name that is not one (a typo, a NUL) by name before any read; a
    # well-formed name this session lacks is 404.
    result = await api.handle(info).history_search(query, checkpoint, limit)
    return {"session": info.id, **result.to_json()}


@router.get("/sessions/{session_id}/history/read", response_model=ReadOut,
            operation_id="historyRead", responses=RECALL)
async def history_read(
        info: Owned, api: ApiDep,
        checkpoint: Annotated[str, Query(
            description="a checkpoint's or a pruned result's name (c12-340, r57)")],
        offset: Annotated[int | None, Query(
            description="the message index to start at (default 0)")] = None,
        cursor: Annotated[str | None, Query(
            description="the cursor the previous page returned")] = None,
        budget_tokens: Annotated[int, Query(
            description=f"most tokens on the page ({MIN_READ_TOKENS}-{MAX_READ_TOKENS})")]
        = DEFAULT_READ_TOKENS) -> dict[str, Any]:
    """A page of the originals ``checkpoint`` replaced, rendered as a transcript; follow
    ``cursor`` for the next page."""
    if offset is not None and cursor is not None:
        raise RecallArgumentError("cursor", "give offset or cursor, not both")
    page = await api.handle(info).history_read(checkpoint, offset or 0, cursor=cursor,
                                               budget_tokens=budget_tokens)
    return {"session": info.id, **page.to_json()}


@router.get("/tools", response_model=ToolsOut, operation_id="recallTools",
            responses={401: COMMON[401]})
async def tools(tenant: Tenant) -> dict[str, Any]:
    """The recall tools' schemas, in OpenAI and Anthropic form, for a runtime to offer its
    model (what ``compactd tools --json`` prints)."""
    return tools_document()
