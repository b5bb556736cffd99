"""What the runtime tells compactd about pressure: a signal (the client's ``signal``) and the
provider's own usage for its last call (the client's ``report_usage``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from compactd.scheduler.http.bodies import in_body
from compactd.scheduler.http.routes.common import API_PREFIX, WITH_BODY, Owned
from compactd.scheduler.http.schemas import SignalIn, SignalOut, UsageIn, UsageOut
from compactd.scheduler.http.state import ApiDep
from compactd.storage.errors import InvalidMessage

router = APIRouter(prefix=API_PREFIX, tags=["sessions"])


@router.post("/sessions/{session_id}/signal", response_model=SignalOut, operation_id="signal",
             responses=WITH_BODY)
async def signal(info: Owned, api: ApiDep,
                 body: Annotated[SignalIn | None, Body()] = None) -> SignalOut:
    """A pressure signal: enqueues one compaction when the trigger fires and none is queued
    or running for the session."""
    result = await api.handle(info).signal((body or SignalIn()).reason)
    return SignalOut(**result.to_json())  # type: ignore[arg-type]


@router.post("/sessions/{session_id}/usage", response_model=UsageOut,
             operation_id="reportUsage", responses=WITH_BODY)
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
