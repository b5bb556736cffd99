"""What the route modules share: the session a request names (path parameter and the
dependencies that check its tenant), and the OpenAPI description of the statuses they answer."""

from __future__ import annotations

import re
import urllib.parse
from typing import Annotated, Any

from fastapi import Depends, Path
from fastapi.responses import JSONResponse
from pydantic import AfterValidator
from starlette.types import ASGIApp, Receive, Scope, Send

from compactd.scheduler.http.auth import Tenant
from compactd.scheduler.http.schemas import ErrorOut, QueuedOut
from compactd.scheduler.http.state import ApiDep
from compactd.storage.errors import SessionNotFound
from compactd.storage.ids import ID_PATTERN, MAX_ID_LENGTH, id_problem
from compactd.storage.records import SessionInfo

API_PREFIX = "/v1"


# ------------------------------------------------------------------------------------------
# the session a request names


SESSIONS_PATH = f"{API_PREFIX}/sessions/"
# How PathSegments escapes a session id in the routed path, and how _session_id reads it back.
_ESCAPES = {"%": "%25", "/": "%2F"}
_ESCAPED = re.compile("%25|%2F")
_UNESCAPED = {escaped: char for char, escaped in _ESCAPES.items()}


class PathSegments:
    """Routes the session id of a request as one path segment, a "/" in it (sent as %2F, as
    the CLI and the client take it) included. The server decodes the path before routing, so
    ``x%2Fsurface`` would reach session x's surface route; the id is read again from the raw
    path and escaped (``%`` and ``/``) in the routed one, and ``SessionId`` unescapes it. Every
    session path is escaped, so what the route reads is never ambiguous."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(SESSIONS_PATH):
            raw = (scope.get("raw_path") or b"").decode("latin-1")
            if raw.startswith(SESSIONS_PATH):
                segment, slash, rest = raw.removeprefix(SESSIONS_PATH).partition("/")
                # Decoded as the server decodes the whole path (bytes not UTF-8 are U+FFFD).
                segment, rest = urllib.parse.unquote(segment), urllib.parse.unquote(rest)
            else:  # no raw path: an id's "/" cannot be told from the path's
                segment, slash, rest = path.removeprefix(SESSIONS_PATH).partition("/")
            escaped = "".join(_ESCAPES.get(char, char) for char in segment)
            scope = {**scope, "path": f"{SESSIONS_PATH}{escaped}{slash}{rest}"}
        await self.app(scope, receive, send)


def _session_id(value: str) -> str:
    value = _ESCAPED.sub(lambda m: _UNESCAPED[m.group()], value)
    # The rule every door applies (storage.ids); its own messages say what is wrong.
    problem = id_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


# Its length is checked unescaped, by the id rule (an id's "/" is three characters routed).
SessionId = Annotated[str, Path(min_length=1,
                                json_schema_extra={"pattern": ID_PATTERN,
                                                   "maxLength": MAX_ID_LENGTH},
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
