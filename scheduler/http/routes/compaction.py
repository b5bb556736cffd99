"""Compactions the runtime asks for: a manual one (the client's ``compact``, then its
``wait_for_run`` under the server's wait limit), the agent's own (its ``compact_context`` tool
call) and one forced by an overflow (the client's ``report_overflow``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Response

from compactd.scheduler.args import parse_keep
from compactd.scheduler.client import WaitTimeout, run_result
from compactd.scheduler.http.bodies import in_body
from compactd.scheduler.http.routes.common import API_PREFIX, WITH_BODY, Owned, queued
from compactd.scheduler.http.schemas import (
    CompactContextIn,
    CompactIn,
    ErrorOut,
    OverflowIn,
    OverflowOut,
    QueuedOut,
    RunOut,
)
from compactd.scheduler.http.state import ApiDep
from compactd.storage.errors import InvalidMessage
from compactd.storage.instructions import check_instructions

router = APIRouter(prefix=API_PREFIX, tags=["sessions"])

MANUAL_COALESCED = ("a manual compaction of this session is already queued and not started; "
                    "this is its task")


@router.post("/sessions/{session_id}/compact", response_model=RunOut, operation_id="compact",
             responses={**WITH_BODY,
                        202: {"model": QueuedOut,
                              "description": "enqueued (not waiting, or not finished yet)"}})
async def compact(info: Owned, api: ApiDep,
                  body: Annotated[CompactIn | None, Body()] = None) -> Any:
    """A manual compaction on ``compaction.urgent``. With ``wait``, the run's result (the
    shape of ``compactd compact --json``); else, or when it has not finished in time, 202.
    While one for the session is queued and not started, this request is that one: the
    same task id, and its options."""
    body = body or CompactIn()
    try:
        keep = parse_keep(body.keep, "keep")
        focus = None if body.instructions is None else check_instructions(body.instructions)
    except InvalidMessage as exc:
        raise in_body(exc) from None
    keep_text = None if keep is None else keep.to_text()
    handle = api.handle(info)
    enqueued = await handle.compact(force=body.force, keep=keep_text, wait=False,
                                    instructions=focus)
    task_id = str(enqueued["task_id"])
    if body.wait:
        timeout_s = api.wait_s(body.timeout_s)
        try:
            run = await handle.wait_for_run(task_id, timeout_s)
        except WaitTimeout:
            return queued(info.id, task_id,
                          f"not finished within {timeout_s:g} s; it may still run")
        return run_result(run, api.config.prices)
    return queued(info.id, task_id, MANUAL_COALESCED if enqueued["coalesced"]
                  else "queued on compaction.urgent")


@router.post("/sessions/{session_id}/compact_context", response_model=QueuedOut,
             operation_id="compactContext", status_code=202,
             responses={**WITH_BODY,
                        429: {"model": ErrorOut,
                              "description": "refused by the loop guard (the message says "
                                             "why); the agent goes on without it"}})
async def compact_context(info: Owned, api: ApiDep,
                          body: Annotated[CompactContextIn, Body()]) -> Any:
    """The agent's ``compact_context(focus)`` tool call: a manual compaction whose instructions
    are the agent's handoff note, queued on ``compaction.urgent`` and never waited for (the
    agent's next step picks up the checkpoint). Refused with 429 while the loop guard holds the
    session."""
    try:
        focus = check_instructions(body.focus, "focus")
    except InvalidMessage as exc:
        raise in_body(exc) from None
    enqueued = await api.handle(info).compact_context(focus)
    return queued(info.id, str(enqueued["task_id"]), MANUAL_COALESCED if enqueued["coalesced"]
                  else "queued on compaction.urgent")


@router.post("/sessions/{session_id}/overflow", response_model=OverflowOut,
             operation_id="reportOverflow",
             response_model_exclude_unset=True,
             responses={**WITH_BODY,
                        202: {"model": OverflowOut,
                              "description": "enqueued (not waiting, or not finished yet)"}})
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
        # The store's poll, not the handle's: the current version, whatever it last read.
        version = await api.store.poll(info.id, None) or 0
        return OverflowOut(compacted=False, version=version, messages=None, run=None,
                           reason=f"not finished within {timeout_s:g} s; it may still run")
    if result.reason == "queued":
        response.status_code = 202
    return OverflowOut(**result.to_json())
