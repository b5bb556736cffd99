"""The bodies of the HTTP API: what each route accepts and answers, as pydantic models (their
JSON Schemas are the OpenAPI document's)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from compactd.storage.ids import ID_PATTERN
from compactd.storage.instructions import MAX_INSTRUCTION_CHARS
from compactd.storage.kinds import FailureClass, RunStatus, SignalReason, Stage


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
    # The runtime's cache hints, which a summary call sharing its cache sends as it does.
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    cache_control: dict[str, Any] | None = None


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


class RunModelIn(_Body):
    run_model: str = Field(min_length=1, max_length=255, pattern=ID_PATTERN,
                           description="the model the agent now talks to")
    context_window: WholeNumber | None = Field(
        default=None, gt=0, le=2_147_483_647,
        description="its window (default: the configured or published one)")


class WindowFitOut(BaseModel):
    window: int
    tokens: int = Field(description="the session's pressure when the model changed")
    reserve: int = Field(description="what its trigger keeps free on the new window")
    fits: bool


class RunModelOut(BaseModel):
    """The session moved to another run model; ``compacting`` when it did not fit the new
    window and a compaction was queued on ``compaction.urgent`` (its ``task_id``)."""

    session: str
    run_model: str
    context_window: int | None
    fit: WindowFitOut | None = Field(description="null when the window is not known")
    compacting: bool
    task_id: str | None


class DeletedOut(BaseModel):
    """A deleted session: the rows removed per table, and the run in flight it cancelled."""

    session: str
    deleted: bool
    rows: dict[str, int]
    cancelled_run: str | None


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
    replayed: bool = Field(default=False, description="the append was made earlier with this "
                           "Idempotency-Key: this is its result, and nothing was stored now")


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
    tokens: int | None = Field(default=None, description="the message's tokens (a "
                               "durable_context checkpoint's count includes its authority "
                               "contract, wherever the contract is placed)")


class SurfaceOut(BaseModel):
    session: str
    version: int
    tokens: int
    messages: list[SurfaceMessage]


class SignalIn(_Body):
    # Not strict: the body's string is the enum's value (strict would take only an instance).
    reason: SignalReason = Field(default=SignalReason.PRESSURE, strict=False)


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
    surface_version: WholeNumber | None = Field(
        default=None, ge=0, le=2**63 - 1,
        description="the surface version the reported call was built on (the ETag of the "
        "surface read, or an append's version; appends since, the reply included, are "
        "counted on top); when a compaction committed after it, the report describes a larger "
        "request than the next one and is not recorded")


class UsageOut(BaseModel):
    session: str
    version: int
    reported_input_tokens: int | None
    reported_output_tokens: int | None
    tokens: int
    applied: bool = Field(description="false: a compaction committed after the surface the "
                                      "report was built on, and it was not recorded")


class CompactIn(_Body):
    force: bool = Field(default=False, description="ignore the trigger and the keep policy")
    keep: str | None = Field(default=None, pattern=r"^(messages|tokens|fraction):[0-9.]+$",
                             description="messages:N | tokens:N | fraction:F, overriding the "
                                         "policy's keep for this run")
    wait: bool = Field(default=False, description="answer with the run's result")
    timeout_s: float | None = Field(default=None, gt=0, le=3600,
                                    description="how long to wait (capped by api.max_wait_s)")
    instructions: str | None = Field(
        default=None, json_schema_extra={"maxLength": MAX_INSTRUCTION_CHARS},
        description="what the summary should focus on for this run (kept by a queued run "
                    "this request coalesces into)")


class CompactContextIn(_Body):
    focus: str = Field(json_schema_extra={"maxLength": MAX_INSTRUCTION_CHARS},
                       description="the agent's handoff note: what the summary must keep")


class RunOut(BaseModel):
    """A finished run, in the shape of ``compactd compact --json``."""

    session: str
    run_id: str
    outcome: RunStatus
    failure_class: FailureClass | None
    tokens_before: int | None
    tokens_after: int | None
    pruned: int
    replaced_seqs: list[int]
    model: str | None
    usage: dict[str, Any] | None = Field(
        default=None, description="tokens the providers billed: input (cached included), "
                                  "cached, cache writes and output, in total and by "
                                  "candidate")
    cost: dict[str, Any] | None = Field(
        default=None, description="the usage at the server's configured prices: usd (null "
                                  "when a candidate that billed has no price), basis, "
                                  "by_candidate")
    stages: list[Stage]
    error: str | None
    candidates: list[dict[str, Any]]
    instructions: list[str] = Field(default_factory=list,
                                    description="what the run was asked to focus on")
    started_at: str
    finished_at: str | None


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
    cost: dict[str, Any] | None = Field(
        default=None, description="every run of the session at the server's configured "
                                  "prices: usd, basis, by_candidate, billed_runs")
    lead: dict[str, Any] | None = Field(
        default=None, description="the lead the session fires early by and why: seconds, "
                                  "source (auto, configured, off, no_growth), why, runs, p90_s")
    waiting_for_growth: dict[str, Any] | None = Field(
        default=None, description="set when a run found nothing worth a run yet (over its "
                                  "trigger, or fired early by its lead): no run fires until it "
                                  "grows to until_tokens (tokens: its pressure now; why)")


class HealthOut(BaseModel):
    ok: bool


class SearchHitOut(BaseModel):
    checkpoint: str = Field(description="the checkpoint or pruned result that replaced the "
                                        "message: history/read's checkpoint")
    seq: int = Field(description="the original message's seq")
    snippet: str
    exact: bool = Field(description="the query is a substring of the message "
                                    "(case-insensitive); exact hits come first")


class ScannedOut(BaseModel):
    messages: int
    bytes: int


class SearchOut(BaseModel):
    session: str
    hits: list[SearchHitOut]
    scanned: ScannedOut = Field(description="the replaced originals the search ran over")


class ReadOut(BaseModel):
    session: str
    checkpoint: str
    transcript: str = Field(description="the originals as a transcript, contents verbatim")
    seqs: list[int]
    offset: int
    next_offset: int | None = Field(description="the index of the first message this page "
                                                "did not begin, always past offset (the rest of "
                                                "a message the page cut is read with cursor; "
                                                "null: no such message)")
    cursor: str | None = Field(description="the next page's exact start, to pass as cursor "
                                           "(null: this was the last page)")
    total_messages: int
    tokens: int


class ToolsOut(BaseModel):
    openai: list[dict[str, Any]]
    anthropic: list[dict[str, Any]]

