"""A session's messages: append one step's (the client's ``append``) and read the surface.

The read is the store's own ``poll`` and ``read_surface``, not the client's ``surface``: the
answer carries the version and token count beside the messages, and an ``If-None-Match`` that
still matches is answered 304 from the version alone."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from compactd.scheduler.http.bodies import in_body
from compactd.scheduler.http.routes.common import (
    API_PREFIX,
    COMMON,
    WITH_BODY,
    Owned,
    error_response,
)
from compactd.scheduler.http.schemas import AppendIn, RenderForm, StepOut, SurfaceOut
from compactd.scheduler.http.state import OFFLOAD_BYTES, ApiDep
from compactd.storage.errors import InvalidMessage
from compactd.storage.ids import check_idempotency_key
from compactd.worker.compaction.render import render_surface

router = APIRouter(prefix=API_PREFIX, tags=["sessions"])

# The header an append's idempotency key comes in (as in Stripe's and others' APIs).
IDEMPOTENCY_HEADER = "Idempotency-Key"
# The longest long poll: a client that wants longer asks again.
MAX_WAIT_S = 60.0
_ETAG = {"ETag": {"description": "the surface version, quoted", "schema": {"type": "string"}}}


def _etag(version: int) -> str:
    return f'"{version}"'


def _one_version(if_none_match: str) -> int | None:
    """The version an ``If-None-Match`` of one tag names; None for a list or ``*``."""
    tag = if_none_match.strip().removeprefix("W/").strip('"')
    return int(tag) if tag.isdigit() else None


def _matches(if_none_match: str, version: int) -> bool:
    for tag in if_none_match.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag.strip('"') == str(version):
            return True
    return False


@router.post("/sessions/{session_id}/messages", response_model=StepOut,
             operation_id="appendMessages",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": AppendIn.model_json_schema()}}}},
             responses={**WITH_BODY, 409: error_response(
                 "the Idempotency-Key was used for an append of other messages")})
async def append(info: Owned, api: ApiDep, request: Request,
                 idempotency_key: Annotated[str | None, Header(
                     alias=IDEMPOTENCY_HEADER,
                     description="makes a retry safe: the same key with the same messages "
                                 "(within retention.append_keys_hours) answers with the first "
                                 "append's result and stores nothing (`replayed`); with other "
                                 "messages, 409. 1-255 printable ASCII characters (a uuid4).")]
                 = None) -> StepOut:
    """Append one step's messages in one transaction. When the trigger fires, one compaction
    is enqueued (the first append of a burst does it); the step never waits for it."""
    if idempotency_key is not None:
        check_idempotency_key(idempotency_key, field=f"header.{IDEMPOTENCY_HEADER}")
    # The body is read here rather than by FastAPI so that a large one is decoded,
    # validated and counted off the event loop (AppendIn is still what it must match).
    raw = await request.body()
    content_type = request.headers.get("content-type")
    batch = await api.offload(raw, content_type, info.run_model) \
        if len(raw) > OFFLOAD_BYTES else \
        api.decode(raw, content_type, info.run_model)
    try:
        step = await api.handle(info).append(batch, idempotency_key=idempotency_key)
    except InvalidMessage as exc:
        raise in_body(exc, "messages") from None
    return StepOut(**step.to_json())


@router.get("/sessions/{session_id}/surface", response_model=SurfaceOut,
            operation_id="readSurface",
            # The messages keep the shape of `compactd surface --json`: absent keys stay absent.
            response_model_exclude_unset=True,
            responses={**COMMON,
                       200: {"description": "the surface", "headers": _ETAG},
                       304: {"description": "unchanged since the version in If-None-Match",
                             "headers": _ETAG}})
async def surface(info: Owned, api: ApiDep,
                  render: Annotated[RenderForm | None, Query(
                      description="how checkpoints read (default: the session's form)")]
                  = None,
                  if_none_match: Annotated[str | None, Header()] = None,
                  wait: Annotated[float | None, Query(
                      ge=0, le=MAX_WAIT_S,
                      description="with If-None-Match of one version: wait up to this many "
                                  "seconds for a compaction to commit past it (a long poll)")]
                  = None) -> Any:
    """The messages the model should see now, checkpoints rendered. With
    ``If-None-Match: "<version>"`` an unchanged surface costs one primary-key read; with
    ``wait`` as well, the answer waits for a compaction's commit (on PostgreSQL its
    notification, not polling) and is 304 only when none came within ``wait`` seconds."""
    if if_none_match:
        version = await api.store.poll(info.id, None)
        if version is not None and _matches(if_none_match, version):
            since = _one_version(if_none_match)
            if not wait or since is None or await api.store.wait_for_version(
                    info.id, since, wait) is None:
                return Response(status_code=304, headers={"ETag": _etag(version)})
    current = await api.store.read_surface(info.id)
    # Encoded here, not through the response model: its encoder refuses values nested
    # deeper than ~255 levels, and a row stored before input depth was bounded must still
    # be served.
    return JSONResponse({"session": info.id, "version": current.version,
                         "tokens": current.tokens,
                         "messages": render_surface(current.nodes, render)},
                        headers={"ETag": _etag(current.version)})
