"""``GET /healthz``: whether this process reaches its database (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter

from compactd.scheduler.http.routes.common import error_response
from compactd.scheduler.http.schemas import HealthOut
from compactd.scheduler.http.state import ApiDep
from compactd.storage.database import ping

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut, operation_id="health",
            responses={503: error_response("the database cannot be reached")})
async def health(api: ApiDep) -> HealthOut:
    """No token needed: whether this process can reach its database."""
    await ping(api.store.engine)
    return HealthOut(ok=True)
