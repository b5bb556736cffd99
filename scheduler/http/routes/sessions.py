"""``/v1/sessions/{id}`` itself: create or open it (the client's ``create_session``), its
status (``compactd status``'s :func:`scheduler.status.session_status`), move it to another run model
(the client's ``set_run_model``), delete it (the client's ``delete``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Response

from compactd.scheduler.client import SessionHandle, check_policy
from compactd.scheduler.http.auth import Tenant
from compactd.scheduler.http.bodies import in_body
from compactd.scheduler.http.routes.common import (
    API_PREFIX,
    COMMON,
    SESSION_LINKS,
    WITH_BODY,
    Claimable,
    Owned,
    SessionId,
    error_response,
)
from compactd.scheduler.http.schemas import (
    DeletedOut,
    RunModelIn,
    RunModelOut,
    SessionIn,
    SessionOut,
    StatusOut,
)
from compactd.scheduler.http.state import ApiDep
from compactd.scheduler.status import session_status
from compactd.storage.errors import InvalidMessage, SessionExists
from compactd.storage.records import SessionInfo

router = APIRouter(prefix=API_PREFIX, tags=["sessions"])


def _session_out(info: SessionInfo, *, created: bool) -> SessionOut:
    return SessionOut(session=info.id, tenant=info.tenant, run_model=info.run_model,
                      context_window=info.context_window, version=info.surface_version,
                      tokens=info.surface_tokens, envelope_tokens=info.envelope_tokens,
                      messages=info.surface_messages, created=created)


@router.put("/sessions/{session_id}", response_model=SessionOut, operation_id="createSession",
            responses={**WITH_BODY,
                       200: {"description": "opened", "links": SESSION_LINKS},
                       201: {"model": SessionOut, "description": "created",
                             "links": SESSION_LINKS},
                       409: error_response("the session exists with another run model")})
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


@router.get("/sessions/{session_id}", response_model=StatusOut, operation_id="sessionStatus",
            responses=COMMON)
async def get_status(info: Owned, api: ApiDep) -> dict[str, Any]:
    """The session's totals, lease, loop-guard flag and recent runs (newest first)."""
    return await session_status(api.store, info.id, prices=api.config.prices,
                                lead_config=api.config)


@router.put("/sessions/{session_id}/run_model", response_model=RunModelOut,
            operation_id="setRunModel", responses=WITH_BODY)
async def set_run_model(info: Owned, api: ApiDep, body: Annotated[RunModelIn, Body()]
                        ) -> dict[str, Any]:
    """The agent moved to another run model. When the session does not fit the new window
    with its reserve, it is compacted at once on ``compaction.urgent`` (``compacting``, and
    the run's ``task_id``)."""
    handle = api.handle(info)
    result = await handle.set_run_model(body.run_model, body.context_window)
    api.remember(handle.info)
    return result


@router.delete("/sessions/{session_id}", response_model=DeletedOut,
               operation_id="deleteSession", responses=COMMON)
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
