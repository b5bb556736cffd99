"""compactd as a LangChain 1.x agent middleware (the ``compactd[langchain]`` extra).

A drop-in alternative to ``SummarizationMiddleware`` that never blocks a step on a summary::

    from langchain.agents import create_agent
    from compactd.scheduler.langchain import CompactdMiddleware

    agent = create_agent(model, tools=tools, system_prompt=SYSTEM,
                         middleware=[CompactdMiddleware()], checkpointer=InMemorySaver())
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "session-1"}})

Before each model call it appends the step's new messages to compactd (one round trip, in which
compactd also decides pressure and enqueues a background compaction when the trigger fires),
and sends the model compactd's newest surface instead of the whole history: the checkpoint a
worker committed, then the messages after it. It never waits for a compaction: a summary still
being written shows up at a later step. After the call it reports the provider's own
``usage_metadata`` (input and output tokens: the response is part of the next request, as
LangChain's own token count has it; the response, appended at the next step, is not counted
twice).

**How state messages map to compactd seqs.** The agent state keeps every original message: only
the model request is compacted (the history stays whole for the checkpointer, the UI and human
review). Two private state fields record the mirroring:

* ``compactd_mirrored``: how many of ``state["messages"]``, from the first, have been appended to
  compactd. They hold seqs 1..N of the session in that order (one batch per step, so a batch's
  seqs are contiguous); ``state["messages"][compactd_mirrored:]`` is what the next append sends.
* ``compactd_last_id``: the id of the last mirrored message. If another middleware rewrote the
  state (removed or replaced messages) the count no longer lines up, and the middleware raises
  rather than mirror the wrong messages.

The model is sent ``surface + state["messages"][compactd_mirrored:]``: the surface covers every
mirrored message (checkpoints in place of the ones they replaced), the tail whatever could not
be mirrored yet. The tail is empty unless compactd could not be reached, in which case the step
goes on with the last surface it read plus the messages since (or, before any surface was read,
with the whole history, as without the middleware). The surface keeps a tool call and its result
together, so the request holds no orphan tool result. An append whose reply was lost may have
committed: the next step reads which of its messages arrived (each carries its LangChain id in
``meta.lc_id``) and appends only the rest, so no message is ever stored twice.

One LangGraph thread is one compactd session (the ``thread_id``, unless ``session_id`` is given),
and the state must persist between invocations (a checkpointer) for the count to survive them: a
fresh state for a session that already holds messages raises instead of appending them twice.

**Recall tools.** The middleware offers the model ``history_search``, ``history_read`` and
``compact_context`` by itself (``recall_tools=False`` turns them off), with the schemas
``compactd tools --json`` prints. ``compact_context(focus)`` queues a manual compaction whose
instructions are the model's handoff note and answers at once (the loop guard may refuse it,
and says why); the checkpoint shows up in the surface of a later step like any other. The
tools act on the step's session (the same id the mirroring uses), the recall ones read only,
and answer like any other tool: the result is a tool message at the tail of the state,
mirrored at the next step like the rest, so the surface stays replayable. A call the checks
refuse (an unknown checkpoint, a cursor of another checkpoint, an empty query...) answers a tool
error naming the argument, for the model to fix; the agent goes on.

compactd I/O runs on the middleware's own event loop thread (its connection pool never crosses
the caller's loops), so the sync (``invoke``) and async (``ainvoke``) paths behave the same.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, NotRequired, TypeVar

from langchain.agents.middleware import AgentMiddleware, AgentState
from langchain.agents.middleware.types import (
    ExtendedModelResponse,
    ModelRequest,
    ModelResponse,
    PrivateStateAttr,
)
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    BaseMessage,
    SystemMessage,
    ToolMessage,
    convert_to_messages,
    convert_to_openai_messages,
)
from langchain_core.tools import BaseTool, StructuredTool, ToolException
from langgraph.runtime import Runtime
from langgraph.types import Command

from compactd.scheduler.client import CompactdClient, SessionHandle, StepResult
from compactd.storage.errors import (
    BadInput,
    CompactdError,
    CompactionRefused,
    RecallArgumentError,
    RecallNotFound,
    SessionNotFound,
)
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import langchain_meta
from compactd.worker.compaction.policy import RENDERS, PolicyError, parse_policy
from compactd.worker.compaction.recall_tools import (
    CompactArgs,
    ReadArgs,
    SearchArgs,
    check_tool_call,
    compact_result_text,
    read_result_text,
    search_result_text,
    tool_schemas,
)
from compactd.worker.compaction.render import AUTHORITY_CONTRACT, append_text, needs_contract
from compactd.worker.runtime import EventLoopThread
from compactd.worker.settings import Config, load_config

logger = logging.getLogger(__name__)

T = TypeVar("T")
META_LC_ID = "lc_id"
STALE = -1  # the version of a view to read again (a poll always finds it moved)
CLOSE_TIMEOUT_S = 10.0


class CompactdState(AgentState[Any]):
    compactd_mirrored: NotRequired[Annotated[int, PrivateStateAttr]]
    compactd_last_id: NotRequired[Annotated[str | None, PrivateStateAttr]]


class StateMismatch(BadInput):
    """The agent state does not line up with what was mirrored into compactd."""


@dataclass(frozen=True, slots=True)
class _View:
    """The surface as LangChain messages, at a surface version. ``contract``: it holds a
    ``durable_context`` checkpoint, whose authority contract the request's system message gets."""

    version: int
    messages: list[BaseMessage]
    contract: bool = False


@dataclass(frozen=True, slots=True)
class _Opening:
    """What the session is created with, read off the first model request."""

    envelope: dict[str, Any] | None
    run_model: str | None
    context_window: int | None


def step_key(session_id: str, after_seq: int, payload: Sequence[Mapping[str, Any]]) -> str:
    """The idempotency key of a step's append: the same messages appended after the same seq
    of the session are one step (a retry); the same messages again, later in the session,
    another step."""
    text = json.dumps([session_id, after_seq, payload], ensure_ascii=False, sort_keys=True,
                      separators=(",", ":"), default=str)
    return "lc-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class _Step:
    """What one model call mirrors: worked out in the caller's thread, cheap and pure."""

    session_id: str
    mirrored: int  # state messages already in compactd
    tail: list[AnyMessage]  # the state messages to append now
    payload: list[dict[str, Any]]  # the tail in compactd's wire shape
    fresh: bool  # no message of this state has been mirrored yet
    opening: _Opening | None  # set until this process has opened the session


# ------------------------------------------------------------------------------------------
# message shapes


def to_compactd(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as OpenAI chat dicts, each remembering its LangChain id.

    The flags ride in ``meta`` as ``compactd ingest --format langchain`` reads them (one
    function, :func:`storage.messages.langchain_meta`): ``additional_kwargs`` (DeerFlow's
    ``dynamic_context_reminder`` and ``hide_from_ui`` tags, a skill read's
    ``skill_context_entry``) and a ToolMessage's error status, which decide what compaction
    rescues and which skill reads count."""
    out: list[dict[str, Any]] = []
    for message in messages:
        meta = langchain_meta({"additional_kwargs": _json_values(message.additional_kwargs),
                               "status": getattr(message, "status", None)})
        if message.id:
            meta[META_LC_ID] = message.id
        converted = convert_to_openai_messages(message)
        for item in converted if isinstance(converted, list) else [converted]:
            item.pop("id", None)
            if meta:
                item["meta"] = dict(meta)
            out.append(item)
    return out


def _json_values(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``additional_kwargs`` JSON can hold. A provider may leave Python objects
    there (a parsed structured output); a transcript file could never carry those, and they
    are not flags."""
    kept: dict[str, Any] = {}
    for key, value in kwargs.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        kept[key] = value
    return kept


def to_langchain(message: Mapping[str, Any]) -> BaseMessage:
    """A rendered surface message as a LangChain message (the id it was mirrored with)."""
    meta = message.get("meta") or {}
    wire = {k: message[k] for k in ("role", "content", "tool_calls", "tool_call_id", "name")
            if message.get(k) is not None}
    wire.setdefault("content", "")
    converted = convert_to_messages([wire])[0]
    converted.id = meta.get(META_LC_ID) or f"compactd-{message['seq']}"
    if isinstance(converted, ToolMessage) and meta.get("is_error"):
        converted.status = "error"  # providers tell the model the call failed
    if meta.get("checkpoint"):
        # What SummarizationMiddleware marks its summary message with.
        converted.additional_kwargs["lc_source"] = "summarization"
    return converted


def _usage(response: Any) -> tuple[int, int] | None:
    """The provider's input and output tokens of the call, when it said them."""
    model_response = response.model_response if isinstance(
        response, ExtendedModelResponse) else response
    messages = model_response.result if isinstance(model_response, ModelResponse) else [
        model_response]
    for message in messages:
        usage = getattr(message, "usage_metadata", None)
        if isinstance(message, AIMessage) and usage and usage.get("input_tokens") is not None:
            return int(usage["input_tokens"]), int(usage.get("output_tokens") or 0)
    return None


# ------------------------------------------------------------------------------------------
# the middleware


class _FromConfig:
    def __repr__(self) -> str:
        return "FROM_CONFIG"


# ``CompactdMiddleware(trigger=...)``'s default: the configuration's trigger (None means off).
FROM_CONFIG: Any = _FromConfig()
# SummarizationMiddleware's keep when none is given.
LANGCHAIN_KEEP = ("messages", 20)


class CompactdMiddleware(AgentMiddleware[CompactdState, Any]):
    """Mirror the agent's messages into compactd and send the model its compacted surface.

    ``trigger``, ``keep``, ``trim_tokens_to_summarize`` and ``summary_prompt`` take what
    SummarizationMiddleware takes (``("tokens", 4000)``, a list of them for OR, a mapping for AND)
    and become the session's policy overrides, which the workers apply; the summary model is
    compactd's (``summarization.model_name`` in its configuration). ``trigger=None`` turns
    automatic compaction off, as in SummarizationMiddleware (the session's policy gets
    ``trigger: []``, which is how compactd's configuration says it; a manual or overflow
    compaction still runs); leaving ``trigger`` out uses the configuration's trigger. A
    ``trigger`` given without ``keep`` keeps the last 20 messages, as SummarizationMiddleware
    does.

    ``session_id``: the compactd session (default: the LangGraph ``thread_id``). ``config``:
    compactd's configuration (default: the ``COMPACTD_*`` environment). ``run_model`` and
    ``context_window`` default to the chat model's name and profile. ``render``: how a
    checkpoint reads to the model (``langchain`` by default: the ``Here is a summary of the
    conversation to date:`` message SummarizationMiddleware writes). ``recall_tools``: offer
    the model ``history_search`` and ``history_read`` (registered as this middleware's
    ``tools``, so ``create_agent`` runs them like its own).
    """

    state_schema = CompactdState

    def __init__(self, session_id: str | None = None, *,
                 trigger: Any = FROM_CONFIG, keep: Any = None,
                 trim_tokens_to_summarize: int | None = None, summary_prompt: str | None = None,
                 config: Config | None = None, tenant: str = "default",
                 run_model: str | None = None, context_window: int | None = None,
                 policy: Mapping[str, Any] | None = None, render: str = "langchain",
                 recall_tools: bool = True) -> None:
        super().__init__()
        if render not in RENDERS:
            raise ValueError(f"render must be one of {', '.join(RENDERS)}, not {render!r}")
        self.session_id = session_id
        self.config = config
        self.tenant = tenant
        self.run_model = run_model
        self.context_window = context_window
        if trigger is FROM_CONFIG:
            trigger = None  # no override: the configuration's (or ``policy``'s) trigger
        elif trigger is None:
            trigger = []  # off, as SummarizationMiddleware(trigger=None) is
        if keep is None and trigger and not (policy or {}).get("keep"):
            # A trigger given here comes with SummarizationMiddleware's keep, not compactd's
            # share of the window, which a small token trigger on a large window would be under.
            keep = LANGCHAIN_KEEP
        self.policy = _session_policy(policy, trigger=trigger, keep=keep,
                                      trim_tokens_to_summarize=trim_tokens_to_summarize,
                                      summary_prompt=summary_prompt)
        self.render = render
        self._bridge: _Bridge | None = None
        self._bridge_lock = threading.Lock()
        # Written only on the bridge's loop.
        self._views: dict[str, _View] = {}
        self._handles: dict[str, SessionHandle] = {}
        self._last_seqs: dict[str, int] = {}  # after this process's last append, per session
        self._unsure: set[str] = set()  # sessions whose last append may or may not have landed
        self.tools: list[BaseTool] = self._recall_tools() if recall_tools else []

    # -------------------------------------------------------------------------------- hooks

    def wrap_model_call(self, request: ModelRequest[Any],
                        handler: Callable[[ModelRequest[Any]], ModelResponse[Any]]) -> Any:
        step = self._plan(request)
        outcome = self._call(lambda: self._mirror(step))
        compacted, mirrored = self._compacted_request(request, step, outcome)
        response = handler(compacted)
        usage = _usage(response)
        if usage is not None:
            self._logged(self._call(lambda: self._report(step.session_id, usage)), step)
        return self._with_update(response, request, mirrored)

    async def awrap_model_call(
            self, request: ModelRequest[Any],
            handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]]) -> Any:
        step = self._plan(request)
        outcome = await self._acall(lambda: self._mirror(step))
        compacted, mirrored = self._compacted_request(request, step, outcome)
        response = await handler(compacted)
        usage = _usage(response)
        if usage is not None:
            self._logged(await self._acall(lambda: self._report(step.session_id, usage)), step)
        return self._with_update(response, request, mirrored)

    def after_agent(self, state: CompactdState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        step = self._final_step(state)
        if step is None:
            return None
        done = self._call(lambda: self._append_only(step))
        return self._mirrored_update(state["messages"], step, done)

    async def aafter_agent(self, state: CompactdState,
                           runtime: Runtime[Any]) -> dict[str, Any] | None:
        step = self._final_step(state)
        if step is None:
            return None
        done = await self._acall(lambda: self._append_only(step))
        return self._mirrored_update(state["messages"], step, done)

    # ----------------------------------------------------------------------- caller's thread

    def _plan(self, request: ModelRequest[Any]) -> _Step:
        state = request.state
        messages = list(state["messages"])
        session_id = self._session()
        mirrored = _mirrored_count(state, messages)
        tail = messages[mirrored:]
        opening = None if session_id in self._handles else _opening(request)
        return _Step(session_id=session_id, mirrored=mirrored, tail=tail,
                     payload=to_compactd(tail), fresh=mirrored == 0, opening=opening)

    def _final_step(self, state: CompactdState) -> _Step | None:
        messages = list(state["messages"])
        mirrored = _mirrored_count(state, messages)
        session_id = self._session()
        if mirrored == len(messages) or session_id not in self._handles:
            return None  # nothing new, or no model call ever opened the session
        tail = messages[mirrored:]
        return _Step(session_id=session_id, mirrored=mirrored, tail=tail,
                     payload=to_compactd(tail), fresh=False, opening=None)

    def _session(self) -> str:
        if self.session_id is not None:
            return self.session_id
        from langgraph.config import get_config

        thread_id = (get_config().get("configurable") or {}).get("thread_id")
        if thread_id is None:
            raise StateMismatch("CompactdMiddleware needs a session_id, or a thread_id in the "
                                "run's config ({'configurable': {'thread_id': ...}})")
        return str(thread_id)

    def _compacted_request(self, request: ModelRequest[Any], step: _Step,
                           outcome: _View | BaseException | None
                           ) -> tuple[ModelRequest[Any], int]:
        """The model request with the surface as its messages (a ``durable_context``
        checkpoint's authority contract coalesced into its system message), and how many state
        messages are mirrored now."""
        messages, mirrored = self._request_messages(request, step, outcome)
        view = outcome if isinstance(outcome, _View) else self._views.get(step.session_id)
        if view is None or not view.contract:
            return request.override(messages=messages), mirrored
        if request.system_message is not None:
            return request.override(messages=messages, system_message=SystemMessage(
                content=append_text(request.system_message.content, AUTHORITY_CONTRACT))), mirrored
        if messages and isinstance(messages[0], SystemMessage):
            # No system prompt of the agent's: the state's own leading one is the request's.
            head = messages[0].model_copy(update={
                "content": append_text(messages[0].content, AUTHORITY_CONTRACT)})
            return request.override(messages=[head, *messages[1:]]), mirrored
        return request.override(messages=messages,
                                system_message=SystemMessage(content=AUTHORITY_CONTRACT)), mirrored

    def _request_messages(self, request: ModelRequest[Any], step: _Step,
                          outcome: _View | BaseException | None) -> tuple[list[Any], int]:
        """The model request's messages, and how many state messages are mirrored now.

        ``outcome``: the new view; None when the tail was stored but the surface could not be
        read; an exception when the tail could not be stored.
        """
        if isinstance(outcome, _View):
            return list(outcome.messages), step.mirrored + len(step.tail)
        if isinstance(outcome, BadInput):
            raise outcome
        stored = outcome is None
        if not stored:
            logger.warning("compactd unreachable, the step goes on without it: %s", outcome,
                           extra={"action": "langchain_mirror_failed",
                                  "session_id": step.session_id})
        mirrored = step.mirrored + (len(step.tail) if stored else 0)
        # The cached view covers exactly the mirrored messages (see _advance).
        cached = self._views.get(step.session_id)
        if cached is None:
            return list(request.messages), mirrored
        return [*cached.messages, *request.state["messages"][mirrored:]], mirrored

    def _with_update(self, response: Any, request: ModelRequest[Any], mirrored: int) -> Any:
        messages = request.state["messages"]
        update = {"compactd_mirrored": mirrored,
                  "compactd_last_id": messages[mirrored - 1].id if mirrored else None}
        if isinstance(response, ExtendedModelResponse):
            # Another middleware's command rides along; ours is applied after it.
            return ExtendedModelResponse(model_response=response.model_response,
                                         command=_merge(response.command, update))
        if isinstance(response, AIMessage):
            response = ModelResponse(result=[response])
        return ExtendedModelResponse(model_response=response, command=Command(update=update))

    def _logged(self, result: object, step: _Step) -> None:
        if isinstance(result, BaseException):
            logger.warning("compactd did not take the usage report: %s", result,
                           extra={"action": "langchain_usage_failed",
                                  "session_id": step.session_id})

    def _mirrored_update(self, messages: Sequence[AnyMessage], step: _Step,
                         done: object) -> dict[str, Any] | None:
        if isinstance(done, BaseException):
            if isinstance(done, BadInput):
                raise done
            logger.warning("compactd unreachable, the final messages stay unmirrored: %s", done,
                           extra={"action": "langchain_mirror_failed",
                                  "session_id": step.session_id})
            return None
        return {"compactd_mirrored": len(messages), "compactd_last_id": messages[-1].id}

    # ------------------------------------------------------------------------ bridge's loop

    async def _open(self, step: _Step) -> SessionHandle:
        handle = self._handles.get(step.session_id)
        if handle is None:
            opening = step.opening or _Opening(None, None, None)
            client = await self._bridge_client()
            handle = await client.create_session(
                step.session_id, tenant=self.tenant,
                run_model=self.run_model or opening.run_model,
                context_window=self.context_window or opening.context_window,
                envelope=opening.envelope, policy=self.policy)
            self._handles[step.session_id] = handle
        return handle

    async def _mirror(self, step: _Step) -> _View | None:
        """Store the tail, then the view to send (None: stored, but the read failed)."""
        handle = await self._open(step)
        # (After an append of ours whose outcome is unknown, the session may hold part of this
        # very tail: _store_tail sorts that out.)
        if step.fresh and step.session_id not in self._unsure:
            info = await handle.client.store.get_session(step.session_id)
            if info.last_seq:
                raise StateMismatch(
                    f"session {step.session_id!r} already holds {info.last_seq} events but this "
                    "agent state has mirrored none: run the agent with a checkpointer (one "
                    "thread per session), or give this run its own session id")
        appended = await self._store_tail(handle, step)
        cached = self._advance(step, appended)
        if cached is not None and cached.version != STALE:
            return cached  # only this append moved the surface: no read
        # From here on the tail is stored: a failure costs this step its fresh view, never a
        # second copy of the tail.
        try:
            if cached is not None and await handle.poll(cached.version) is None:
                return cached
            # A checkpoint (or another writer) moved it: one read, never a wait.
            rendered = await handle.surface(self.render, contract=False)
            view = _View(handle.version, [to_langchain(m) for m in rendered],
                         needs_contract(rendered))
        except Exception as exc:
            if isinstance(exc, BadInput):
                raise
            logger.warning("compactd stored the step but its surface could not be read: %s",
                           exc, extra={"action": "langchain_read_failed",
                                       "session_id": step.session_id})
            return None
        self._views[step.session_id] = view
        return view

    async def _append_only(self, step: _Step) -> bool:
        handle = await self._open(step)
        self._advance(step, await self._store_tail(handle, step))
        return True

    def _advance(self, step: _Step, appended: StepResult | None) -> _View | None:
        """The cached view once the tail is stored: it keeps covering exactly the mirrored
        messages (what a step falls back on), current when only this append moved the surface,
        else STALE, to be read again."""
        cached = self._views.get(step.session_id)
        if cached is None or not step.tail:
            return cached
        current = appended is not None and appended.version == cached.version + 1
        view = _View(appended.version if current and appended is not None else STALE,
                     [*cached.messages, *step.tail], cached.contract)
        self._views[step.session_id] = view
        return view

    async def _store_tail(self, handle: SessionHandle, step: _Step) -> StepResult | None:
        """Append what of the tail compactd does not hold yet; None when it holds all of it.

        An append that failed without an answer (a timeout, a dropped connection) may still
        have committed. The client makes it again with its idempotency key (:func:`step_key`),
        so a retry answers with what the first stored. If every retry failed, the tail is
        appended again at the next step, so that step first reads which of its messages did
        arrive (by the LangChain id each carries in ``meta``) and appends only the rest: the
        session never holds a message twice.
        """
        sid = step.session_id
        payload = step.payload
        if sid in self._unsure:
            events = await handle.client.store.read_events(
                sid, kinds=[NodeKind.MESSAGE], after_seq=self._last_seqs.get(sid, 0))
            arrived = {(e.payload.get("meta") or {}).get(META_LC_ID) for e in events} - {None}
            payload = [m for m in payload if m.get("meta", {}).get(META_LC_ID) not in arrived]
        if not payload:
            self._unsure.discard(sid)
            return None
        try:
            appended = await handle.append(
                payload, idempotency_key=step_key(sid, self._last_seqs.get(sid, 0), payload))
        except BadInput:
            raise  # refused whole: nothing was stored
        except Exception:
            self._unsure.add(sid)
            raise
        self._unsure.discard(sid)
        self._last_seqs[sid] = appended.last_seq
        return appended

    async def _report(self, session_id: str, usage: tuple[int, int]) -> None:
        handle = self._handles.get(session_id)
        if handle is not None:
            # The response is mirrored with the next step's messages, after this report.
            await handle.report_usage(*usage, response_appended=False)

    async def _bridge_client(self) -> CompactdClient:
        bridge = self._bridge
        assert bridge is not None
        if bridge.client is None:
            client = CompactdClient(self.config or load_config())
            await client.__aenter__()
            bridge.client = client
        return bridge.client

    # ----------------------------------------------------------------------- run model

    def set_run_model(self, name: str, context_window: int | None = None, *,
                      session_id: str | None = None) -> dict[str, Any]:
        """The agent moves to run model ``name`` (its window ``context_window``): the
        session's ``set_run_model`` (compacted at once on ``compaction.urgent`` when it does
        not fit the new window with its reserve; the next step picks the checkpoint up), and
        this middleware opens sessions with that model from now on. ``session_id``: the
        session (default: the middleware's, else the current run's thread)."""
        target = session_id or self._session()
        result = self._call(lambda: self._set_run_model(target, name, context_window))
        if isinstance(result, BaseException):
            raise result
        return result

    async def aset_run_model(self, name: str, context_window: int | None = None, *,
                             session_id: str | None = None) -> dict[str, Any]:
        target = session_id or self._session()
        result = await self._acall(lambda: self._set_run_model(target, name, context_window))
        if isinstance(result, BaseException):
            raise result
        return result

    async def _set_run_model(self, session_id: str, name: str, context_window: int | None
                             ) -> dict[str, Any]:
        handle = await self._recall_handle(session_id)
        result = await handle.set_run_model(name, context_window)
        self._handles[session_id] = handle
        self.run_model, self.context_window = name, result["context_window"]
        return result

    # ------------------------------------------------------------------------ recall tools

    def _recall_tools(self) -> list[BaseTool]:
        """The two recall tools from the shipped schemas: the model is sent what
        ``compactd tools --json`` prints, and the checks behind them are the same."""
        return [self._recall_tool(schema["function"]) for schema in tool_schemas("openai")]

    def _recall_tool(self, function: Mapping[str, Any]) -> BaseTool:
        name = function["name"]

        def run(**arguments: Any) -> str:
            return self._recall(name, arguments)

        async def arun(**arguments: Any) -> str:
            return await self._arecall(name, arguments)

        # A ToolException answers the model as the tool's error message (status "error")
        # instead of stopping the agent: a refused argument is the model's to fix, and an
        # outage costs it this one recall.
        return StructuredTool(name=name, description=function["description"],
                              args_schema=dict(function["parameters"]), func=run,
                              coroutine=arun, handle_tool_error=True)

    def _recall(self, name: str, arguments: dict[str, Any]) -> str:
        session_id, args = self._recall_call(name, arguments)
        return _recall_answer(name, session_id,
                              self._call(lambda: self._recall_run(session_id, args)))

    async def _arecall(self, name: str, arguments: dict[str, Any]) -> str:
        session_id, args = self._recall_call(name, arguments)
        return _recall_answer(name, session_id,
                              await self._acall(lambda: self._recall_run(session_id, args)))

    def _recall_call(self, name: str, arguments: dict[str, Any]
                     ) -> tuple[str, SearchArgs | ReadArgs | CompactArgs]:
        """The session and the checked arguments, in the caller's thread: a refused call costs
        no round trip."""
        session_id = self._session()
        try:
            return session_id, check_tool_call(name, arguments)
        except RecallArgumentError as exc:
            raise ToolException(_refused(name, exc.argument, exc.reason)) from None

    async def _recall_run(self, session_id: str, args: SearchArgs | ReadArgs | CompactArgs
                          ) -> str:
        handle = await self._recall_handle(session_id)
        if isinstance(args, CompactArgs):
            # Queued, never waited for: a later step's surface holds the checkpoint.
            queued = await handle.compact_context(args.focus)
            return compact_result_text(queued)
        if isinstance(args, SearchArgs):
            found = await handle.history_search(
                args.query, None if args.checkpoint is None else str(args.checkpoint),
                args.limit)
            return search_result_text(found.to_json())
        page = await handle.history_read(str(args.checkpoint), args.offset, cursor=args.cursor,
                                         budget_tokens=args.budget_tokens)
        return read_result_text(page.to_json())

    async def _recall_handle(self, session_id: str) -> SessionHandle:
        """The session as this process opened it, else opened now (a tool run before any model
        call of this process, after a restart), never created: a tool must not create it."""
        handle = self._handles.get(session_id)
        if handle is not None:
            return handle
        client = await self._bridge_client()
        handle = await client.get_session(session_id)
        if handle.info.tenant != self.tenant:
            raise SessionNotFound(session_id)
        return handle

    # ------------------------------------------------------------------------------ bridge

    def _get_bridge(self) -> _Bridge:
        with self._bridge_lock:
            if self._bridge is None:
                self._bridge = _Bridge()
            return self._bridge

    def _call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T | BaseException:
        """Run ``make()`` on the bridge; a failure is returned, not raised, for the caller to
        judge (bad input raises, an outage degrades)."""
        try:
            return self._get_bridge().thread.submit(make)
        except Exception as exc:
            return exc

    async def _acall(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T | BaseException:
        bridge = self._get_bridge()
        future = asyncio.run_coroutine_threadsafe(make(), bridge.thread.loop)
        try:
            return await asyncio.wrap_future(future)
        except Exception as exc:
            return exc

    def close(self) -> None:
        """Close the connection pool and stop the loop thread (idempotent)."""
        with self._bridge_lock:
            bridge, self._bridge = self._bridge, None
        if bridge is not None:
            bridge.close()


class _Bridge:
    """The middleware's event loop thread and the compactd client living on it."""

    def __init__(self) -> None:
        self.thread = EventLoopThread(name="compactd-langchain")
        self.client: CompactdClient | None = None

    def close(self) -> None:
        client = self.client
        if client is not None:
            try:
                self.thread.submit(client.aclose, timeout=CLOSE_TIMEOUT_S)
            except (CompactdError, concurrent.futures.TimeoutError, OSError) as exc:
                logger.warning("closing the compactd client failed: %s", exc,
                               extra={"action": "langchain_close"})
        self.thread.stop()


# ------------------------------------------------------------------------------------------


def _mirrored_count(state: Mapping[str, Any], messages: Sequence[AnyMessage]) -> int:
    mirrored = int(state.get("compactd_mirrored") or 0)
    last_id = state.get("compactd_last_id")
    if mirrored > len(messages) or (mirrored and messages[mirrored - 1].id != last_id):
        raise StateMismatch(
            f"the agent state no longer holds the {mirrored} messages mirrored into compactd "
            "(another middleware rewrote state['messages']?); CompactdMiddleware must be the "
            "only middleware that compacts messages")
    return mirrored


def _opening(request: ModelRequest[Any]) -> _Opening:
    """The envelope (system prompt and tool schemas, sent with every call, so they count toward
    pressure), and the chat model's name and window when it says them."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    envelope: dict[str, Any] = {}
    if request.system_prompt:
        envelope["system"] = request.system_prompt
    tools = []
    for tool in request.tools:
        try:
            tools.append(tool if isinstance(tool, dict) else convert_to_openai_tool(tool))
        except (TypeError, ValueError):  # a provider-native tool with no OpenAI schema
            continue
    if tools:
        envelope["tools"] = tools
    name = getattr(request.model, "model_name", None) or getattr(request.model, "model", None)
    profile = getattr(request.model, "profile", None)
    window = profile.get("max_input_tokens") if isinstance(profile, Mapping) else None
    return _Opening(envelope=envelope or None, run_model=name if isinstance(name, str) else None,
                    context_window=window if isinstance(window, int) else None)


def _session_policy(policy: Mapping[str, Any] | None, **overrides: Any
                    ) -> dict[str, Any] | None:
    """The session's policy overrides as JSON values, checked now rather than at the first
    step."""
    merged = {**(policy or {}), **{k: v for k, v in overrides.items() if v is not None}}
    if not merged:
        return None
    plain: dict[str, Any] = json.loads(json.dumps(merged))  # tuples become lists, as stored
    try:
        parse_policy(plain, path="policy")
    except PolicyError as exc:
        raise ValueError(str(exc)) from None
    return plain


def _refused(name: str, argument: str, reason: str) -> str:
    return f"{name} refused its {argument} argument: {reason}"


def _recall_answer(name: str, session_id: str, outcome: str | BaseException) -> str:
    """A recall tool's result text, or the ToolException that answers the model instead."""
    if isinstance(outcome, str):
        return outcome
    if isinstance(outcome, RecallArgumentError):
        raise ToolException(_refused(name, outcome.argument, outcome.reason))
    if isinstance(outcome, RecallNotFound):
        raise ToolException(_refused(
            name, "checkpoint", f"this conversation has no checkpoint or pruned result "
                                f"{outcome.ref!r} (use a name the conversation shows or a "
                                f"history_search hit gives)"))
    if isinstance(outcome, SessionNotFound):
        raise ToolException(f"{name}: nothing of this conversation is stored in compactd yet")
    if isinstance(outcome, CompactionRefused):
        # The loop guard's own words: why, and that the agent should go on.
        raise ToolException(str(outcome))
    if isinstance(outcome, BadInput):
        raise ToolException(f"{name}: {outcome}")
    logger.warning("a recall tool could not reach compactd: %s", outcome,
                   extra={"action": "langchain_recall_failed", "session_id": session_id})
    raise ToolException(f"{name} is unavailable right now (compactd could not be reached); the "
                        "conversation goes on without it")


def _merge(command: Command[Any] | None, update: dict[str, Any]) -> Command[Any]:
    if command is None:
        return Command(update=update)
    existing = command.update if isinstance(command.update, dict) else {}
    return Command(graph=command.graph, update={**existing, **update}, resume=command.resume,
                   goto=command.goto)


__all__ = ["CompactdMiddleware", "CompactdState", "StateMismatch", "to_compactd",
           "to_langchain"]

