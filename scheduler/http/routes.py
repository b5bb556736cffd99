"""The routes of the HTTP API (listed in ``scheduler.http.server``), each the Python client's
call of the same name, and the OpenAPI description of every status each can answer."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import AfterValidator

from scheduler.args import parse_keep
from scheduler.client import SessionHandle, WaitTimeout, check_policy, run_result
from scheduler.http.auth import Tenant
from scheduler.http.bodies import decode_append, in_body
from scheduler.http.schemas import (
    AppendIn,
    CompactIn,
    DeletedOut,
    ErrorOut,
    HealthOut,
    OverflowIn,
    OverflowOut,
    QueuedOut,
    ReadOut,
    RenderForm,
    RunOut,
    SearchOut,
    SessionIn,
    SessionOut,
    SignalIn,
    SignalOut,
    StatusOut,
    StepOut,
    SurfaceOut,
    ToolsOut,
    UsageIn,
    UsageOut,
)
from scheduler.http.state import OFFLOAD_BYTES, ApiDep
from scheduler.status import session_status
from storage.database import ping
from storage.errors import InvalidMessage, RecallArgumentError, SessionExists, SessionNotFound
from storage.ids import ID_PATTERN, MAX_ID_LENGTH, id_problem
from storage.recall_bounds import (
    DEFAULT_READ_TOKENS,
    DEFAULT_SEARCH_LIMIT,
    MAX_READ_TOKENS,
    MIN_READ_TOKENS,
)
from storage.records import SessionInfo
from worker.compaction.recall import parse_ref
from worker.compaction.recall_tools import tools_document
from worker.compaction.render import render_surface

API_PREFIX = "/v1"
MANUAL_COALESCED = ("a manual compaction of this session is already queued and not started; "
                    "this is its task")


# ------------------------------------------------------------------------------------------
# the session a request names


def _session_id(value: str) -> str:
    # The rule every door applies (storage.ids); its own messages say what is wrong.
    problem = id_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


SessionId = Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH,
                                json_schema_extra={"pattern": ID_PATTERN},
                                description="the session id (global across tenants): printable "
                                            "text, valid UTF-8"),
                      AfterValidator(_session_id)]


async def _owned(session_id: SessionId, tenant: Tenant, api: ApiDep) -> SessionInfo:
    # A dependency, so FastAPI runs it before it validates the body: a request for another
    # tenant's session answers 404 whatever it carries.
    return await api.owned(session_id, tenant)


Owned = Annotated[SessionInfo, Depends(_owned)]


async def _claimable(session_id: SessionId, tenant: Tenant, api: ApiDep) -> SessionInfo | None:
    """This tenant's session, or None when the id is free; another tenant's is not found."""
    try:
        info = await api.store.get_session(session_id)
    except SessionNotFound:
        return None
    api.remember(info)
    if info.tenant != tenant:
        raise SessionNotFound(session_id)
    return info


Claimable = Annotated[SessionInfo | None, Depends(_claimable)]


# ------------------------------------------------------------------------------------------
# OpenAPI: every status each route can answer, with its body


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorOut, "description": description}


_COMMON: dict[int | str, dict[str, Any]] = {
    401: _error("no bearer token, or one that is not valid"),
    404: _error("no such session for this token's tenant"),
    422: _error("a field is not valid; `field` names it"),
    503: _error("the database or the broker cannot be reached; retry"),
}
_RECALL: dict[int | str, dict[str, Any]] = {
    **_COMMON,
    404: _error("no such session for this token's tenant, or no such checkpoint or pruned "
                "result in it"),
}
_WITH_BODY: dict[int | str, dict[str, Any]] = {
    **_COMMON,
    400: _error("the body is not JSON"),
    408: _error("the body did not arrive within api.body_timeout_s"),
    413: _error("the body is over api.max_body_bytes"),
}
# What a created or opened session leads to (OpenAPI links: generated clients and stateful
# testers follow them).
_SESSION_LINKS = {
    name: {"operationId": name, "parameters": {"session_id": "$response.body#/session"}}
    for name in ("sessionStatus", "appendMessages", "readSurface", "signal", "reportUsage",
                 "compact", "reportOverflow")}
_ETAG = {"ETag": {"description": "the surface version, quoted", "schema": {"type": "string"}}}


# ------------------------------------------------------------------------------------------
# routes


def _session_out(info: SessionInfo, *, created: bool) -> SessionOut:
    return SessionOut(session=info.id, tenant=info.tenant, run_model=info.run_model,
                      context_window=info.context_window, version=info.surface_version,
                      tokens=info.surface_tokens, envelope_tokens=info.envelope_tokens,
                      messages=info.surface_messages, created=created)


def _etag(version: int) -> str:
    return f'"{version}"'


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


def add_routes(app: FastAPI) -> None:
    @app.get("/healthz", response_model=HealthOut, tags=["health"], operation_id="health",
             responses={503: _error("the database cannot be reached")})
    async def health(api: ApiDep) -> HealthOut:
        """No token needed: whether this process can reach its database."""
        await ping(api.store.engine)
        return HealthOut(ok=True)

    @app.put(API_PREFIX + "/sessions/{session_id}", response_model=SessionOut,
             operation_id="createSession",
             responses={**_WITH_BODY,
                        200: {"description": "opened", "links": _SESSION_LINKS},
                        201: {"model": SessionOut, "description": "created",
                              "links": _SESSION_LINKS},
                        409: _error("the session exists with another run model")},
             tags=["sessions"])
    async def create_session(session_id: SessionId, tenant: Tenant, api: ApiDep,
                             existing: Claimable, response: Response,
                             body: Annotated[SessionIn | None, Body()] = None) -> SessionOut:
        """Create the session, or open it when it exists for this tenant with the same run
        model (its envelope, policy and context window are updated)."""
        body = body or SessionIn()
        check_policy(body.policy, api.config)

        async def open_with(run_model: str | None) -> SessionHandle:
            return await api.client.create_session(
                session_id, tenant=tenant, run_model=run_model,
                context_window=body.context_window,
                envelope=body.envelope.model_dump(exclude_none=True)
                if body.envelope is not None else None,
                policy=body.policy)

        try:
            handle = await open_with(body.run_model if body.run_model is not None
                                     or existing is None else existing.run_model)
        except SessionExists:
            # Created meanwhile by another tenant: as invisible as one that existed before.
            created_meanwhile = await api.owned(session_id, tenant, fresh=True)
            if body.run_model is not None:
                raise
            # Created meanwhile by this tenant: a body without a run model opens it, as it
            # would have had it come a moment later.
            handle = await open_with(created_meanwhile.run_model)
        except InvalidMessage as exc:
            raise in_body(exc) from None
        api.remember(handle.info)
        if handle.created:
            response.status_code = 201
        return _session_out(handle.info, created=handle.created)

    @app.get(API_PREFIX + "/sessions/{session_id}", response_model=StatusOut,
             operation_id="sessionStatus",
             responses=_COMMON, tags=["sessions"])
    async def get_status(info: Owned, api: ApiDep) -> dict[str, Any]:
        """The session's totals, lease, loop-guard flag and recent runs (newest first)."""
        return await session_status(api.store, info.id, prices=api.config.prices,
                                    lead_config=api.config)

    @app.delete(API_PREFIX + "/sessions/{session_id}", response_model=DeletedOut,
                operation_id="deleteSession", responses=_COMMON, tags=["sessions"])
    async def delete_session(session_id: SessionId, tenant: Tenant, api: ApiDep) -> DeletedOut:
        """Delete the session and every row of it (log, surface, recall index, runs, journal,
        pending signal); a run in flight ends cancelled. Another tenant's session is not found,
        and nothing of it is deleted."""
        api.forget(session_id)
        try:
            result = await api.client.delete(session_id, tenant=tenant)
        finally:
            api.forget(session_id)
        return DeletedOut(**result.to_json())

    @app.post(API_PREFIX + "/sessions/{session_id}/messages", response_model=StepOut,
              operation_id="appendMessages",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": AppendIn.model_json_schema()}}}},
              responses=_WITH_BODY, tags=["sessions"])
    async def append(info: Owned, api: ApiDep, request: Request) -> StepOut:
        """Append one step's messages in one transaction. When the trigger fires, one compaction
        is enqueued (the first append of a burst does it); the step never waits for it."""
        # The body is read here rather than by FastAPI so that a large one is decoded,
        # validated and counted off the event loop (AppendIn is still what it must match).
        raw = await request.body()
        content_type = request.headers.get("content-type")
        batch = await api.offload(raw, content_type, info.run_model) \
            if len(raw) > OFFLOAD_BYTES else \
            decode_append(raw, content_type, info.run_model, encoded=api.store.db.encodes_appends)
        try:
            step = await api.handle(info).append(batch)
        except InvalidMessage as exc:
            raise in_body(exc, "messages") from None
        return StepOut(**step.to_json())

    @app.get(API_PREFIX + "/sessions/{session_id}/surface", response_model=SurfaceOut,
             operation_id="readSurface",
             # The messages keep the shape of `compactd surface --json`: absent keys stay absent.
             response_model_exclude_unset=True,
             responses={**_COMMON,
                        200: {"description": "the surface", "headers": _ETAG},
                        304: {"description": "unchanged since the version in If-None-Match",
                              "headers": _ETAG}},
             tags=["sessions"])
    async def surface(info: Owned, api: ApiDep,
                      render: Annotated[RenderForm | None, Query(
                          description="how checkpoints read (default: the session's form)")]
                      = None,
                      if_none_match: Annotated[str | None, Header()] = None) -> Any:
        """The messages the model should see now, checkpoints rendered. With
        ``If-None-Match: "<version>"`` an unchanged surface costs one primary-key read."""
        if if_none_match:
            version = await api.store.poll(info.id, None)
            if version is not None and _matches(if_none_match, version):
                return Response(status_code=304, headers={"ETag": _etag(version)})
        current = await api.store.read_surface(info.id)
        # Encoded here, not through the response model: its encoder refuses values nested
        # deeper than ~255 levels, and a row stored before input depth was bounded must still
        # be served.
        return JSONResponse({"session": info.id, "version": current.version,
                             "tokens": current.tokens,
                             "messages": render_surface(current.nodes, render)},
                            headers={"ETag": _etag(current.version)})

    @app.get(API_PREFIX + "/sessions/{session_id}/history/search", response_model=SearchOut,
             operation_id="historySearch", responses=_RECALL, tags=["recall"])
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
        # A name that is not one (a typo, a NUL) is refused by name before any read; a
        # well-formed name this session lacks is 404.
        ref = None if checkpoint is None else str(parse_ref(checkpoint))
        result = await api.store.history_search(info.id, query, ref, limit, tenant=info.tenant)
        return {"session": info.id, **result.to_json()}

    @app.get(API_PREFIX + "/sessions/{session_id}/history/read", response_model=ReadOut,
             operation_id="historyRead", responses=_RECALL, tags=["recall"])
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
        page = await api.store.history_read(
            info.id, str(parse_ref(checkpoint)), offset or 0, cursor=cursor,
            budget_tokens=budget_tokens, tenant=info.tenant)
        return {"session": info.id, **page.to_json()}

    @app.get(API_PREFIX + "/tools", response_model=ToolsOut, operation_id="recallTools",
             responses={401: _COMMON[401]}, tags=["recall"])
    async def tools(tenant: Tenant) -> dict[str, Any]:
        """The recall tools' schemas, in OpenAI and Anthropic form, for a runtime to offer its
        model (what ``compactd tools --json`` prints)."""
        return tools_document()

    @app.post(API_PREFIX + "/sessions/{session_id}/signal", response_model=SignalOut,
              operation_id="signal",
              responses=_WITH_BODY, tags=["sessions"])
    async def signal(info: Owned, api: ApiDep,
                     body: Annotated[SignalIn | None, Body()] = None) -> SignalOut:
        """A pressure signal: enqueues one compaction when the trigger fires and none is queued
        or running for the session."""
        result = await api.handle(info).signal((body or SignalIn()).reason)
        return SignalOut(**result.to_json())  # type: ignore[arg-type]

    @app.post(API_PREFIX + "/sessions/{session_id}/usage", response_model=UsageOut,
              operation_id="reportUsage",
              responses=_WITH_BODY, tags=["sessions"])
    async def usage(info: Owned, api: ApiDep, body: UsageIn) -> UsageOut:
        """The provider's own usage for the runtime's last call; pressure uses the larger of
        compactd's count and its input plus output plus what is appended after the response."""
        try:
            updated = await api.handle(info).report_usage(
                body.input_tokens, body.output_tokens, response_appended=body.response_appended,
                surface_version=body.surface_version)
        except InvalidMessage as exc:
            raise in_body(exc) from None
        return UsageOut(session=updated.id, version=updated.surface_version,
                        reported_input_tokens=updated.reported_input_tokens,
                        reported_output_tokens=updated.reported_output_tokens,
                        tokens=updated.surface_tokens,
                        applied=(body.surface_version is None
                                 or not updated.compacted_since(body.surface_version)))

    @app.post(API_PREFIX + "/sessions/{session_id}/compact", response_model=RunOut,
              operation_id="compact",
              responses={**_WITH_BODY,
                         202: {"model": QueuedOut,
                               "description": "enqueued (not waiting, or not finished yet)"}},
              tags=["sessions"])
    async def compact(info: Owned, api: ApiDep,
                      body: Annotated[CompactIn | None, Body()] = None) -> Any:
        """A manual compaction on ``compaction.urgent``. With ``wait``, the run's result (the
        shape of ``compactd compact --json``); else, or when it has not finished in time, 202.
        While one for the session is queued and not started, this request is that one: the
        same task id, and its options."""
        body = body or CompactIn()
        try:
            keep = parse_keep(body.keep, "keep")
        except InvalidMessage as exc:
            raise in_body(exc) from None
        keep_text = None if keep is None else keep.to_text()
        handle = api.handle(info)
        queued = await handle.compact(force=body.force, keep=keep_text, wait=False)
        task_id = str(queued["task_id"])
        if body.wait:
            timeout_s = api.wait_s(body.timeout_s)
            try:
                run = await handle._wait_for_run(task_id, timeout_s)
            except WaitTimeout:
                return _queued(info.id, task_id,
                               f"not finished within {timeout_s:g} s; it may still run")
            return run_result(run, api.config.prices)
        return _queued(info.id, task_id, MANUAL_COALESCED if queued["coalesced"]
                       else "queued on compaction.urgent")

    @app.post(API_PREFIX + "/sessions/{session_id}/overflow", response_model=OverflowOut,
              operation_id="reportOverflow",
              response_model_exclude_unset=True,
              responses={**_WITH_BODY,
                         202: {"model": OverflowOut,
                               "description": "enqueued (not waiting, or not finished yet)"}},
              tags=["sessions"])
    async def overflow(info: Owned, api: ApiDep, response: Response,
                       body: Annotated[OverflowIn | None, Body()] = None) -> OverflowOut:
        """The provider said the context overflowed: force a compaction now. When even a forced
        run could not shrink the surface the answer comes at once (``compacted`` false), so the
        runtime can raise the provider's own error."""
        body = body or OverflowIn()
        timeout_s = api.wait_s(body.timeout_s)
        try:
            result = await api.handle(info).report_overflow(wait=body.wait, timeout_s=timeout_s)
        except WaitTimeout:
            response.status_code = 202
            version = await api.store.poll(info.id, None) or 0
            return OverflowOut(compacted=False, version=version, messages=None, run=None,
                               reason=f"not finished within {timeout_s:g} s; it may still run")
        if result.reason == "queued":
            response.status_code = 202
        return OverflowOut(**result.to_json())


def _queued(session_id: str, task_id: str, reason: str) -> JSONResponse:
    # Returned as a response, not a model: the route's response_model is the 200 body.
    body = QueuedOut(session=session_id, outcome="queued", task_id=task_id, reason=reason)
    return JSONResponse(body.model_dump(), status_code=202)

