"""The HTTP API of ``compactd serve``: the runtime contract for runtimes in any language.

Every route under ``/v1`` is the Python client's call of the same name (``scheduler.client``)::

    PUT  /v1/sessions/{id}             create the session, or open it (updates envelope, policy)
    GET  /v1/sessions/{id}             status: totals, lease, loop-guard flag, recent runs
    POST /v1/sessions/{id}/messages    append one step's messages (pressure is decided here)
    GET  /v1/sessions/{id}/surface     what the model should see now; ETag = surface version
    POST /v1/sessions/{id}/signal      a pressure signal (de-duplicated)
    POST /v1/sessions/{id}/usage       the provider's own input/output tokens for the last call
    POST /v1/sessions/{id}/compact     a manual compaction, optionally waiting for its result
    POST /v1/sessions/{id}/overflow    the provider said the context overflowed

A runtime polls with ``GET .../surface`` and ``If-None-Match: "<version>"``: one primary-key
read, answered 304 while nothing changed.

**Tenants.** Every ``/v1`` route takes ``Authorization: Bearer <token>``; the token names a
tenant (``api.tokens`` in the YAML file) and a tenant sees only its own sessions: another
tenant's session answers 404 exactly like a missing one, on every route. Session ids are global,
so creating an id another tenant holds answers 404 too (and so tells the caller the id is taken):
give sessions unguessable ids. Tokens are compared as SHA-256 digests in constant time and never
logged.

**Errors** share one body, ``{"error", "message", "field", "index"}``: 401 no or unknown token,
404 no such session (for this tenant), 408 the body did not arrive within ``api.body_timeout_s``,
409 the session exists with another run model, 413 the body is over ``api.max_body_bytes``, 422
a field is not valid (``field`` names it, e.g. ``body.messages[3].tool_call_id``), 503 the
database or the broker cannot be reached (retry).

One engine and connection pool per server process, and its CPU processes (``api.cpu_processes``),
opened by the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import functools
import hashlib
import hmac
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Body, Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.client import (
    CompactdClient,
    SessionHandle,
    WaitTimeout,
    check_policy,
    parse_messages,
    run_result,
)
from scheduler.commands import parse_keep
from scheduler.status import session_status
from storage.database import ping
from storage.errors import (
    BadInput,
    CompactdError,
    ConfigError,
    DatabaseUnavailable,
    InvalidMessage,
    SessionExists,
    SessionNotFound,
    StorageError,
)
from storage.ids import ID_PATTERN, MAX_ID_LENGTH, id_problem
from storage.messages import TOO_DEEP
from storage.records import SessionInfo
from storage.store import PreparedAppend, Store, prepare_append
from worker.compaction.render import render_surface
from worker.enqueue import broker_errors
from worker.settings import ApiConfig, Config

logger = logging.getLogger(__name__)

API_PREFIX = "/v1"
POOL_SIZE = 10  # per server process; SQLAlchemy may open as many again under a burst
RETRY_AFTER_S = 1
_BODY_TOO_DEEP = f"the body is not valid: {TOO_DEEP}"
_SESSION_CACHE_MAX = 100_000
# An append body over this is decoded, parsed and counted in the API's CPU processes (see
# Api.offload); under it the hop costs more than the work it moves.
OFFLOAD_BYTES = 32 * 1024
_WARM_BODY = b'{"messages": [{"role": "user", "content": "warm"}]}'


def _whole(value: Any) -> Any:
    # JSON Schema's integer includes 5.0; strict validation alone would refuse it.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WholeNumber = Annotated[int, BeforeValidator(_whole)]
RenderForm = Literal["durable_context", "compacted_summary", "langchain"]
MessageFormat = Literal["openai", "anthropic", "langchain"]


# ------------------------------------------------------------------------------------------
# bodies


class _Body(BaseModel):
    # Strict: "true" is not a boolean and "5" is not a number; what the schema says is what
    # is accepted.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class ErrorOut(BaseModel):
    error: str = Field(description="unauthorized, not_found, conflict, too_large, invalid, "
                                   "bad_request, method_not_allowed, timeout, unavailable")
    message: str
    field: str | None = Field(default=None, description="the offending field, as a path")
    index: int | None = Field(default=None, description="the offending message of a batch")


class EnvelopeIn(_Body):
    """What the runtime sends with every call besides the surface: it counts toward pressure."""

    system: str | None = None
    tools: list[dict[str, Any]] | None = None


class SessionIn(_Body):
    run_model: str | None = Field(default=None, min_length=1, max_length=255,
                                  pattern=ID_PATTERN)
    context_window: WholeNumber | None = Field(default=None, gt=0, le=2_147_483_647)
    envelope: EnvelopeIn | None = None
    policy: dict[str, Any] | None = Field(
        default=None, description="overrides of the configured summarization policy")


class SessionOut(BaseModel):
    session: str
    tenant: str
    run_model: str | None
    context_window: int | None
    version: int
    tokens: int
    envelope_tokens: int
    messages: int
    created: bool


# The three wire shapes, documented (and so reachable by schema-driven fuzzers); the importers
# of ``storage.messages`` validate each message against the shape ``format`` names.
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "null"},
                      {"type": "array", "items": {"type": ["object", "string"]},
                       "description": "content blocks; a string block is a text block"}]}
_OPENAI_MESSAGE = {
    "title": "OpenAIMessage", "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "content": _CONTENT,
        "tool_calls": {"type": ["array", "null"], "items": {
            "type": "object", "required": ["id", "function"],
            "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 255,
                                  "description": "no NUL character"},
                           "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"},
                                                       "arguments": {"type": "string"}}}}}},
        "tool_call_id": {"type": ["string", "null"]},
        "name": {"type": ["string", "null"]},
        "meta": {"type": ["object", "null"],
                 "description": "flags for compactd (pinned, dynamic_context_reminder, ...); "
                                "the keys a compaction writes (checkpoint, summary, render, "
                                "run_id, pruned, ...) are refused"},
    },
}
_ANTHROPIC_MESSAGE = {
    "title": "AnthropicMessage", "type": "object", "required": ["role"],
    "description": "format: anthropic (tool_use / tool_result blocks)",
    "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": _CONTENT,
                   "meta": {"type": ["object", "null"]}},
}
_LANGCHAIN_MESSAGE = {
    "title": "LangChainMessage", "type": "object", "required": ["type"],
    "description": "format: langchain (message.model_dump() or messages_to_dict output)",
    "properties": {"type": {"type": "string"}, "content": _CONTENT,
                   "data": {"type": "object"}},
}
WireMessage = Annotated[dict[str, Any], WithJsonSchema(
    {"anyOf": [_OPENAI_MESSAGE, _ANTHROPIC_MESSAGE, _LANGCHAIN_MESSAGE]})]


class AppendIn(_Body):
    messages: list[WireMessage] = Field(
        min_length=1, description="one step's messages in the wire format `format` names "
                                  "(OpenAI chat dicts by default, plus an optional `meta`)")
    format: MessageFormat = "openai"


class StepOut(BaseModel):
    version: int
    first_seq: int
    last_seq: int
    tokens: int = Field(description="surface tokens after the append")
    messages: int = Field(description="surface nodes after the append")
    fired: bool = Field(description="the trigger fires on the new totals")
    signalled: bool = Field(description="this append marked the session and sent a compaction "
                            "to the queue (in the background; a failed send is logged and frees "
                            "the mark for the next append)")


class FunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionOut


class SurfaceMessage(BaseModel):
    """One message of the surface in OpenAI chat shape; a checkpoint has ``meta.checkpoint``."""

    seq: int
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    meta: dict[str, Any] | None = None
    tokens: int | None = Field(default=None, description="absent on the authority contract a "
                                                         "durable_context checkpoint adds")


class SurfaceOut(BaseModel):
    session: str
    version: int
    tokens: int
    messages: list[SurfaceMessage]


class SignalIn(_Body):
    reason: Literal["pressure", "step", "append"] = "pressure"


class SignalOut(BaseModel):
    session: str
    enqueued: bool
    reason: str
    task_id: str | None


class UsageIn(_Body):
    input_tokens: WholeNumber = Field(ge=0, le=2_147_483_647)
    output_tokens: WholeNumber = Field(default=0, ge=0, le=2_147_483_647)
    response_appended: bool = Field(
        default=True, description="false when the call's response is appended after this "
        "report: output_tokens then stands for it and it is not counted twice")


class UsageOut(BaseModel):
    session: str
    version: int
    reported_input_tokens: int | None
    reported_output_tokens: int | None
    tokens: int


class CompactIn(_Body):
    force: bool = Field(default=False, description="ignore the trigger and the keep policy")
    keep: str | None = Field(default=None, pattern=r"^(messages|tokens|fraction):[0-9.]+$",
                             description="messages:N | tokens:N | fraction:F, overriding the "
                                         "policy's keep for this run")
    wait: bool = Field(default=False, description="answer with the run's result")
    timeout_s: float | None = Field(default=None, gt=0, le=3600,
                                    description="how long to wait (capped by api.max_wait_s)")


class RunOut(BaseModel):
    """A finished run, in the shape of ``compactd compact --json``."""

    session: str
    run_id: str
    outcome: str
    failure_class: str | None
    tokens_before: int | None
    tokens_after: int | None
    pruned: int
    replaced_seqs: list[int]
    model: str | None
    usage: dict[str, Any] | None = Field(
        default=None, description="tokens the providers billed: input (cached included), "
                                  "cached and output, in total and by candidate")
    stages: list[str]
    error: str | None
    candidates: list[dict[str, Any]]
    started_at: str
    finished_at: str | None


MANUAL_COALESCED = ("a manual compaction of this session is already queued and not started; "
                    "this is its task")


class QueuedOut(BaseModel):
    session: str
    outcome: Literal["queued"]
    task_id: str
    reason: str


class OverflowIn(_Body):
    wait: bool = Field(default=False, description="wait for the forced compaction")
    timeout_s: float | None = Field(default=None, gt=0, le=3600,
                                    description="how long to wait (capped by api.max_wait_s)")


class OverflowOut(BaseModel):
    compacted: bool
    reason: str
    version: int
    messages: list[SurfaceMessage] | None = Field(
        description="the smaller surface, when the forced compaction committed")
    run: dict[str, Any] | None
    pruned: int = Field(default=0, description="tool results the run pruned (committed even "
                                               "when its summary then failed)")
    tokens_after: int | None = Field(default=None,
                                     description="the session's pressure after the run")


class StatusOut(BaseModel):
    session: str
    tenant: str
    run_model: str | None
    version: int
    tokens: int
    envelope_tokens: int
    messages: int
    lease: dict[str, Any] | None
    flagged: dict[str, Any] | None
    runs: list[dict[str, Any]]


class HealthOut(BaseModel):
    ok: bool


# ------------------------------------------------------------------------------------------
# tokens


class Tokens:
    """Bearer tokens and their tenants, held as SHA-256 digests.

    Hashing first makes every comparison one between two 32-byte values, so neither a token's
    length nor its prefix shows in the time an answer takes; every digest is compared, so
    neither does which one matched.
    """

    def __init__(self, digests: list[tuple[bytes, str]]) -> None:
        if not digests:
            raise ConfigError("api.tokens: no bearer token is configured; compactd serve "
                              "does not run without one")
        self._digests = digests

    @classmethod
    def from_config(cls, api: ApiConfig, environ: Mapping[str, str] | None = None) -> Tokens:
        environ = os.environ if environ is None else environ
        digests: list[tuple[bytes, str]] = []
        for i, entry in enumerate(api.tokens):
            if entry.token_env is not None:
                secret = environ.get(entry.token_env, "")
                if not secret:
                    raise ConfigError(f"api.tokens[{i}].token_env: the environment variable "
                                      f"{entry.token_env} is not set")
                digests.append((_digest(secret), entry.tenant))
            else:
                assert entry.token_sha256 is not None
                digests.append((bytes.fromhex(entry.token_sha256), entry.tenant))
        return cls(digests)

    def tenant(self, token: str) -> str | None:
        presented = _digest(token)
        found: str | None = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(digest, presented) and found is None:
                found = tenant
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_sha256(token: str) -> str:
    """The value for ``api.tokens[].token_sha256``."""
    return _digest(token).hex()


# ------------------------------------------------------------------------------------------
# the application's per-process state


class Api:
    """What the routes share: one client (one engine and pool) and the tenants of sessions."""

    def __init__(self, config: Config, client: CompactdClient) -> None:
        self.config = config
        self.client = client
        # A session's tenant never changes, so the check on the hot path (append, poll) reads
        # the database only the first time a process sees a session.
        self._sessions: dict[str, SessionInfo] = {}
        # The event loop answers every tenant: a 4 MB append decoded and counted on it held
        # every other request for seconds, and on a thread of this process it still shared the
        # GIL with the loop (another tenant's p99 near 80 ms). In a process of its own it takes
        # nothing from the loop but the bytes sent and the strings and numbers sent back.
        # 'spawn': a child inherits no event loop, connection or lock of this process.
        processes = config.api.cpu_processes
        self._processes: ProcessPoolExecutor | None = None
        if processes and not client.store.sqlite:
            self._processes = _process_pool(processes)
        # SQLite's append stores the parsed messages themselves, which cost the loop more to
        # unpickle than to build; with cpu_processes 0 the PostgreSQL batches come here too.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compactd-api-cpu")
        self._warming: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the CPU processes now, so that the first large append does not wait for
        them to start and import compactd (seconds)."""
        if self._processes is not None:
            self._warming = asyncio.get_running_loop().create_task(self._warm(self._processes))

    async def _warm(self, pool: ProcessPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        # One task each: the pool starts a process for each task no idle process takes.
        warm = functools.partial(_decode_plain, _WARM_BODY, "application/json", None)
        with contextlib.suppress(BrokenProcessPool, RuntimeError):
            await asyncio.gather(*(loop.run_in_executor(pool, warm)
                                   for _ in range(self.config.api.cpu_processes)))

    def close(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
        if self._processes is not None:
            self._processes.shutdown(wait=False, cancel_futures=True)
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def offload(self, raw: bytes, content_type: str | None,
                      run_model: str | None) -> PreparedAppend:
        """An append body decoded, validated, parsed and counted (see ``_decode_append``) off
        the event loop."""
        loop = asyncio.get_running_loop()
        pool = self._processes
        if pool is None:
            return await loop.run_in_executor(self._thread, functools.partial(
                _decode_append, raw, content_type, run_model, encoded=not self.store.sqlite))
        try:
            outcome = await loop.run_in_executor(
                pool, functools.partial(_decode_plain, raw, content_type, run_model))
        except BrokenProcessPool:
            # A CPU process died (killed, out of memory): the next request gets a new pool.
            if self._processes is pool:
                logger.warning("an API CPU process died; starting new ones",
                               extra={"action": "api_cpu_restart"})
                self._processes = _process_pool(self.config.api.cpu_processes)
                self.start()
            raise StarletteHTTPException(
                503, "the body could not be processed; retry",
                headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return _raise_plain(outcome)

    @property
    def store(self) -> Store:
        return self.client.store

    def wait_s(self, asked: float | None) -> float:
        limit = self.config.api.max_wait_s
        return limit if asked is None else min(asked, limit)

    async def owned(self, session_id: str, tenant: str, *, fresh: bool = False) -> SessionInfo:
        """The session, if ``tenant`` owns it; another tenant's is not found, like a missing one."""
        info = None if fresh else self._sessions.get(session_id)
        if info is None:
            info = await self.store.get_session(session_id)
            self.remember(info)
        if info.tenant != tenant:
            raise SessionNotFound(session_id)
        return info

    def remember(self, info: SessionInfo) -> None:
        if len(self._sessions) >= _SESSION_CACHE_MAX:
            self._sessions.clear()
        self._sessions[info.id] = info

    def handle(self, info: SessionInfo) -> SessionHandle:
        return SessionHandle(self.client, info)


def _process_pool(processes: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))


def _api(request: Request) -> Api:
    api: Api = request.app.state.api
    return api


_bearer = HTTPBearer(auto_error=False, description="a token of api.tokens; it names a tenant")


class Unauthorized(BadInput):
    """A bearer token is required."""


async def _tenant(request: Request,
                  credentials: Annotated[HTTPAuthorizationCredentials | None,
                                         Depends(_bearer)]) -> str:
    if credentials is None:
        raise Unauthorized("an Authorization: Bearer <token> header is required")
    tenant = request.app.state.tokens.tenant(credentials.credentials)
    if tenant is None:
        raise Unauthorized("the bearer token is not valid")
    return str(tenant)


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
Tenant = Annotated[str, Depends(_tenant)]
ApiDep = Annotated[Api, Depends(_api)]


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
            raise _in_body(exc) from None
        api.remember(handle.info)
        if handle.created:
            response.status_code = 201
        return _session_out(handle.info, created=handle.created)

    @app.get(API_PREFIX + "/sessions/{session_id}", response_model=StatusOut,
             operation_id="sessionStatus",
             responses=_COMMON, tags=["sessions"])
    async def get_status(info: Owned, api: ApiDep) -> dict[str, Any]:
        """The session's totals, lease, loop-guard flag and recent runs (newest first)."""
        return await session_status(api.store, info.id)

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
            _decode_append(raw, content_type, info.run_model, encoded=not api.store.sqlite)
        try:
            step = await api.handle(info).append(batch)
        except InvalidMessage as exc:
            raise _in_body(exc, "messages") from None
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
                body.input_tokens, body.output_tokens, response_appended=body.response_appended)
        except InvalidMessage as exc:
            raise _in_body(exc) from None
        return UsageOut(session=updated.id, version=updated.surface_version,
                        reported_input_tokens=updated.reported_input_tokens,
                        reported_output_tokens=updated.reported_output_tokens,
                        tokens=updated.surface_tokens)

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
            raise _in_body(exc) from None
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
            return run_result(run)
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


def _decode_append(raw: bytes, content_type: str | None, run_model: str | None, *,
                   encoded: bool) -> PreparedAppend:
    """An append body, validated as FastAPI validates a body (JSON only under a JSON content
    type, errors located under ``body``), parsed and counted for ``run_model``. No I/O."""
    body: Any = raw
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    header = email.message.Message()
    header["content-type"] = content_type or ""
    subtype = header.get_content_subtype()
    if content_type and header.get_content_maintype() == "application" and \
            (subtype == "json" or subtype.endswith("+json")):
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                           "msg": "JSON decode error", "input": {},
                                           "ctx": {"error": exc.msg}}]) from None
        except RecursionError:
            # Nested past the parser's limit: input nested too deep, as FastAPI's reader's is.
            raise InvalidMessage(_BODY_TOO_DEEP, field="body") from None
        except ValueError:
            # Not UTF-8: FastAPI's answer for such bodies.
            raise StarletteHTTPException(400, "There was an error parsing the body") from None
    try:
        valid = AppendIn.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in exc.errors(include_url=False)]) from None
    try:
        return prepare_append(parse_messages(valid.messages, valid.format), run_model,
                              encoded=encoded)
    except InvalidMessage as exc:
        raise _in_body(exc, "messages") from None


def _decode_plain(raw: bytes, content_type: str | None, run_model: str | None
                  ) -> tuple[Any, ...]:
    """``_decode_append`` for PostgreSQL in a CPU process: the batch (strings, numbers and
    tool links), or its error as plain data, for ``_raise_plain`` to raise in the server."""
    try:
        return ("batch", _decode_append(raw, content_type, run_model, encoded=True))
    except RequestValidationError as exc:
        # Only what the error handler reads: an error's input and context may hold the
        # message's content and objects that do not pickle.
        return ("request", [{"type": error.get("type"), "loc": tuple(error.get("loc", ())),
                             "msg": error.get("msg"), "input": None,
                             "ctx": {"error": str((error.get("ctx") or {}).get("error", ""))}}
                            for error in exc.errors()])
    except StarletteHTTPException as exc:
        return ("http", exc.status_code, exc.detail)
    except InvalidMessage as exc:
        return ("message", exc.reason, exc.index, exc.field)


def _raise_plain(outcome: tuple[Any, ...]) -> PreparedAppend:
    kind, *rest = outcome
    if kind == "request":
        raise RequestValidationError(rest[0])
    if kind == "http":
        raise StarletteHTTPException(rest[0], rest[1])
    if kind == "message":
        raise InvalidMessage(rest[0], index=rest[1], field=rest[2])
    batch: PreparedAppend = rest[0]
    return batch


def _queued(session_id: str, task_id: str, reason: str) -> JSONResponse:
    # Returned as a response, not a model: the route's response_model is the 200 body.
    body = QueuedOut(session=session_id, outcome="queued", task_id=task_id, reason=reason)
    return JSONResponse(body.model_dump(), status_code=202)


def _in_body(exc: InvalidMessage, collection: str | None = None) -> InvalidMessage:
    """The error located in the request body, as FastAPI names its own validation errors."""
    where = "body"
    if collection is not None:
        where += f".{collection}" + (f"[{exc.index}]" if exc.index is not None else "")
    field = f"{where}.{exc.field}" if exc.field else where
    return InvalidMessage(exc.reason, index=exc.index, field=field)


# ------------------------------------------------------------------------------------------
# errors


def _error_response(status: int, error: str, message: str, *, field: str | None = None,
                    index: int | None = None, headers: dict[str, str] | None = None
                    ) -> JSONResponse:
    body = ErrorOut(error=error, message=message, field=field, index=index)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _unavailable(message: str) -> JSONResponse:
    return _error_response(503, "unavailable", message,
                           headers={"Retry-After": str(RETRY_AFTER_S)})


_HTTP_ERRORS = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                405: "method_not_allowed", 408: "timeout", 413: "too_large", 503: "unavailable"}


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


def add_error_handlers(app: FastAPI) -> None:
    async def unauthorized(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(401, "unauthorized", str(exc),
                               headers={"WWW-Authenticate": "Bearer"})

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(404, "not_found", str(exc))

    async def conflict(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(409, "conflict", str(exc))

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidMessage)
        return _error_response(422, "invalid", exc.reason, field=exc.field, index=exc.index)

    async def bad_input(request: Request, exc: Exception) -> JSONResponse:
        # ConfigError messages start with the key path (``policy.trigger[0]: ...``).
        text = str(exc)
        head, sep, _ = text.partition(": ")
        field = f"body.{head}" if sep and head.startswith("policy") else None
        return _error_response(422, "invalid", text, field=field)

    async def request_invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid"}
        if first.get("type") == "json_invalid":
            # Its loc ends with a character offset, not a field.
            error = (first.get("ctx") or {}).get("error", "")
            return _error_response(422, "invalid", f"the body is not valid JSON: {error}",
                                   field="body")
        field = _location(first.get("loc", ()))
        # A validator's own ValueError reads "Value error, <its message>".
        message = str(first.get("msg")).removeprefix("Value error, ")
        return _error_response(422, "invalid", f"{field}: {message}",
                               field=field or None)

    async def storage_failed(request: Request, exc: Exception) -> JSONResponse:
        logger.warning("storage failed: %s", exc, extra={"action": "api_unavailable"})
        # Where the database lives is the operator's business (the log), not the caller's.
        return _unavailable("the database cannot be reached; retry"
                            if isinstance(exc, DatabaseUnavailable) else str(exc))

    async def broker_failed(request: Request, exc: Exception) -> JSONResponse:
        # The body says only what a caller can act on (retry); the log names the broker,
        # without its password, for the operator.
        from scheduler.cli import redact_url

        logger.warning("broker failed: the broker cannot be reached at %s: %s",
                       redact_url(_api(request).config.broker_url), type(exc).__name__,
                       extra={"action": "api_unavailable"})
        return _unavailable("the broker cannot be reached; retry")

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            # FastAPI's body reader hit Python's JSON depth limit: invalid input, said so.
            return _error_response(422, "invalid", _BODY_TOO_DEEP, field="body")
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return _error_response(exc.status_code, _HTTP_ERRORS.get(exc.status_code, "error"),
                               str(exc.detail), headers=headers or None)

    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(SessionNotFound, not_found)
    app.add_exception_handler(SessionExists, conflict)
    app.add_exception_handler(InvalidMessage, invalid)
    app.add_exception_handler(BadInput, bad_input)
    app.add_exception_handler(RequestValidationError, request_invalid)
    app.add_exception_handler(StorageError, storage_failed)
    for cls in broker_errors():
        app.add_exception_handler(cls, broker_failed)
    app.add_exception_handler(StarletteHTTPException, http_error)


# ------------------------------------------------------------------------------------------
# the body limit


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes "
                              "(api.max_body_bytes)")


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s "
                              "(api.body_timeout_s)", headers={"Connection": "close"})


class BodyLimit:
    """Refuse a request body over ``max_bytes``: by its Content-Length before reading it, else
    as it streams in (a chunked body has no length to check). The whole body must arrive within
    ``timeout_s`` of the first read: a client that announces more than it sends gets 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                error = BodyTooLarge(self.max_bytes)
                response = _error_response(413, "too_large", str(error.detail))
                await response(scope, receive, send)
                return
        received = 0
        deadline: float | None = None

        async def limited() -> Message:
            nonlocal received, deadline
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                # An HTTPException, as below; the connection is closed after the answer (the
                # rest of the body may still come, and would be read as the next request).
                raise BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException, so FastAPI's body reader passes it to the handler above
                    # instead of turning it into a 400.
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


# ------------------------------------------------------------------------------------------
# the application and the server


def create_app(config: Config, *, environ: Mapping[str, str] | None = None) -> FastAPI:
    """The API for ``config``; tokens named by environment variables are read now, so a
    missing one stops the server before it listens."""
    tokens = Tokens.from_config(config.api, environ)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store.from_url(config.database_url, pool_size=POOL_SIZE)
        try:
            async with CompactdClient(config, store=store) as client:
                app.state.api = Api(config, client)
                app.state.api.start()
                try:
                    yield
                finally:
                    app.state.api.close()
        finally:
            await store.close()

    app = FastAPI(
        title="compactd", version="1",
        summary="Out-of-band context compaction for LLM agent runtimes",
        description=__doc__, lifespan=lifespan,
        docs_url="/docs" if config.api.docs else None,
        redoc_url="/redoc" if config.api.docs else None)
    app.state.tokens = tokens
    add_routes(app)
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.api.max_body_bytes,
                       timeout_s=config.api.body_timeout_s)
    return app


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.listening.set()


async def serve(config: Config, *, host: str, port: int) -> None:
    """Run the API until SIGINT/SIGTERM; prints the address it listens on (port 0: any free)."""
    app = create_app(config)
    server = _Server(uvicorn.Config(
        app, host=host, port=port, lifespan="on", log_config=None, server_header=False,
        proxy_headers=False))
    serving = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait({serving, listening}, return_when=asyncio.FIRST_COMPLETED)
    if server.listening.is_set():
        bound = server.servers[0].sockets[0].getsockname()
        # Tests and supervisors read the port from this line when they asked for port 0.
        sys.stdout.write(f"compactd API listening on http://{bound[0]}:{bound[1]}\n")
        sys.stdout.flush()
    else:
        listening.cancel()
    await serving
    if not server.listening.is_set():
        raise CompactdError("the API did not start (see the log above)")
