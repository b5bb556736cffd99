"""What the route modules share: the session a request names (path parameter and the
dependencies that check its tenant), and the OpenAPI description of the statuses they answer."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path
from fastapi.responses import JSONResponse
from pydantic import AfterValidator

from compactd.scheduler.http.auth import Tenant
from compactd.scheduler.http.schemas import ErrorOut, QueuedOut
from compactd.scheduler.http.state import ApiDep
from compactd.storage.errors import SessionNotFound
from compactd.storage.ids import ID_PATTERN, MAX_ID_LENGTH, id_problem
from compactd.storage.records import SessionInfo

API_PREFIX = "/v1"


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


def error_response(description: str) -> dict[str, Any]:
    return {"model": ErrorOut, "description": description}


COMMON: dict[int | str, dict[str, Any]] = {
    401: error_response("no bearer token, or one that is not valid"),
    404: error_response("no such session for this token's tenant"),
    422: error_response("a field is not valid; `field` names it"),
    503: error_response("the database or the broker cannot be reached; retry"),
}
RECALL: dict[int | str, dict[str, Any]] = {
    **COMMON,
    404: error_response("no such session for this token's tenant, or no such checkpoint or "
                        "pruned result in it"),
}
WITH_BODY: dict[int | str, dict[str, Any]] = {
    **COMMON,
    400: error_response("the body is not JSON"),
    408: error_response("the body did not arrive within api.body_timeout_s"),
    413: error_response("the body is over api.max_body_bytes"),
}
# What a created or opened session leads to (OpenAPI links: generated clients and stateful
# testers follow them).
SESSION_LINKS = {
    name: {"operationId": name, "parameters": {"session_id": "$response.body#/session"}}
    for name in ("sessionStatus", "appendMessages", "readSurface", "signal", "reportUsage",
                 "compact", "reportOverflow")}


def queued(session_id: str, task_id: str, reason: str) -> JSONResponse:
    """202 with a run's task id: returned as a response, not a model, since the route's
    response_model is its 200 body."""
    body = QueuedOut(session=session_id, outcome="queued", task_id=task_id, reason=reason)
    return JSONResponse(body.model_dump(), status_code=202)
