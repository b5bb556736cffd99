"""One error body for every answer that is not a success, ``{"error", "message", "field",
"index"}``: compactd's exceptions, FastAPI's and Starlette's mapped to their status."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from compactd.scheduler.http.auth import Unauthorized
from compactd.scheduler.http.bodies import BODY_TOO_DEEP, is_json_type
from compactd.scheduler.http.schemas import ErrorOut
from compactd.scheduler.output import redact_url
from compactd.storage.errors import (
    BadInput,
    CompactionRefused,
    DatabaseMissing,
    DatabaseUnavailable,
    IdempotencyKeyReused,
    InvalidMessage,
    RecallArgumentError,
    RecallNotFound,
    SessionExists,
    SessionNotFound,
    StorageError,
)
from compactd.worker.enqueue import broker_errors
from compactd.worker.settings import Config, plain_problem

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


def error_response(status: int, error: str, message: str, *, field: str | None = None,
                    index: int | None = None, headers: dict[str, str] | None = None
                    ) -> JSONResponse:
    body = ErrorOut(error=error, message=message, field=field, index=index)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _unavailable(message: str) -> JSONResponse:
    return error_response(503, "unavailable", message,
                           headers={"Retry-After": str(RETRY_AFTER_S)})


# What pydantic says of a body that is not an object: under a content type that is not JSON,
# the bytes themselves (FastAPI reads only JSON as JSON).
_NOT_AN_OBJECT = ("model_attributes_type", "model_type", "dict_type")

_HTTP_ERRORS = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                405: "method_not_allowed", 408: "timeout", 413: "too_large", 429: "refused",
                503: "unavailable"}


def _location(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE and isinstance(route, APIRoute | Route):
            methods |= route.methods or set()
    return sorted(methods)


def _without_slash(request: Request) -> str | None:
    """The path of a request that ends with a slash, without it, when a route serves that."""
    path = request.url.path
    if len(path) < 2 or not path.endswith("/"):
        return None
    scope = {**request.scope, "path": path.rstrip("/")}
    if any(route.matches(scope)[0] != Match.NONE for route in request.app.routes
           if isinstance(route, APIRoute | Route)):
        return str(scope["path"])
    return None


def add_error_handlers(app: FastAPI, config: Config) -> None:
    async def unauthorized(request: Request, exc: Exception) -> JSONResponse:
        return error_response(401, "unauthorized", str(exc),
                               headers={"WWW-Authenticate": "Bearer"})

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(404, "not_found", str(exc))

    async def conflict(request: Request, exc: Exception) -> JSONResponse:
        return error_response(409, "conflict", str(exc))

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidMessage)
        # Named as a body that fails its schema is (``body.instructions: is empty``); a message
        # of an append is named by its index instead.
        message = exc.reason if exc.field is None or exc.index is not None \
            else f"{exc.field}: {exc.reason}"
        return error_response(422, "invalid", message, field=exc.field, index=exc.index)

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return error_response(429, "refused", str(exc))

    async def bad_input(request: Request, exc: Exception) -> JSONResponse:
        # ConfigError messages start with the key path (``policy.trigger[0]: ...``).
        text = str(exc)
        head, sep, _ = text.partition(": ")
        field = f"body.{head}" if sep and head.startswith("policy") else None
        return error_response(422, "invalid", text, field=field)

    async def recall_invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RecallArgumentError)
        # The recall routes take their arguments in the query string.
        return error_response(422, "invalid", str(exc), field=f"query.{exc.argument}")

    async def request_invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid"}
        if first.get("type") == "json_invalid":
            # Its loc ends with a character offset, not a field.
            error = (first.get("ctx") or {}).get("error", "")
            return error_response(422, "invalid", f"the body is not valid JSON: {error}",
                                   field="body")
        field = _location(first.get("loc", ()))
        content_type = request.headers.get("content-type")
        if field == "body" and first.get("type") in _NOT_AN_OBJECT and \
                not is_json_type(content_type):
            return error_response(
                422, "invalid", f"the body must be JSON sent with Content-Type: application/json "
                                f"(this request's is {(content_type or 'none')[:100]})",
                field="body")
        return error_response(422, "invalid", f"{field}: {plain_problem(first)}",
                               field=field or None)

    async def storage_failed(request: Request, exc: Exception) -> JSONResponse:
        logger.warning("storage failed: %s", exc, extra={"action": "api_unavailable"})
        # Where the database lives is the operator's business (the log), not the caller's.
        if isinstance(exc, DatabaseMissing):
            return _unavailable("the server's database is not configured correctly")
        return _unavailable("the database cannot be reached; retry"
                            if isinstance(exc, DatabaseUnavailable) else str(exc))

    async def broker_failed(request: Request, exc: Exception) -> JSONResponse:
        # The body says only what a caller can act on (retry); the log names the broker,
        # without its password, for the operator.
        logger.warning("broker failed: the broker cannot be reached at %s: %s",
                       redact_url(config.broker_url), type(exc).__name__,
                       extra={"action": "api_unavailable"})
        return _unavailable("the broker cannot be reached; retry")

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            # FastAPI's body reader hit Python's JSON depth limit: invalid input, said so.
            return error_response(422, "invalid", BODY_TOO_DEEP, field="body")
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        detail = str(exc.detail)
        if exc.status_code == 404 and (route := _without_slash(request)) is not None:
            detail = f"no route {request.url.path}: the route is {route}, without the slash"
        return error_response(exc.status_code, _HTTP_ERRORS.get(exc.status_code, "error"),
                               detail, headers=headers or None)

    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(SessionNotFound, not_found)
    app.add_exception_handler(RecallNotFound, not_found)
    app.add_exception_handler(RecallArgumentError, recall_invalid)
    app.add_exception_handler(SessionExists, conflict)
    app.add_exception_handler(IdempotencyKeyReused, conflict)
    app.add_exception_handler(InvalidMessage, invalid)
    app.add_exception_handler(CompactionRefused, refused)
    app.add_exception_handler(BadInput, bad_input)
    app.add_exception_handler(RequestValidationError, request_invalid)
    app.add_exception_handler(StorageError, storage_failed)
    for cls in broker_errors():
        app.add_exception_handler(cls, broker_failed)
    app.add_exception_handler(StarletteHTTPException, http_error)
