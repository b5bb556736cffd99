"""What every provider's error translation shares: an HTTP error response, a failed connection,
a request the SDK refused and an answer that does not parse, each as a
:class:`~worker.llm.errors.ProviderError`.

Nothing here names an SDK's exceptions: each provider module catches its own SDK's and calls
these with what they carry (status, headers, the error object, the exception's cause).
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Mapping
from typing import Any

from compactd.storage.kinds import ModelFailure
from compactd.worker.llm.errors import ProviderError

_CONTEXT_MARKERS = ("context_length_exceeded", "maximum context length", "context length",
                    "prompt is too long", "too many tokens", "input is too long",
                    "context window")
_QUOTA_CODES = frozenset({"insufficient_quota", "enforced_spend_limit_reached",
                          "contract_spend_limit_reached", "billing_hard_limit_reached"})
_SAFE_CODE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def status_error(status: int, headers: Mapping[str, str], error: Mapping[str, Any], *,
                 request_id: str | None) -> ProviderError:
    """The :class:`ProviderError` for an HTTP error response.

    ``error`` is the provider's error object (``{"type", "code", "message"}``). Its message is
    read to recognise a context-length error but never copied into the reason: only status, type
    and code, which are identifiers, are.
    """
    etype = _safe(error.get("type"))
    code = _safe(error.get("code")) or _safe(_get(error, "details", "error_code"))
    message = str(error.get("message") or "").lower()
    label = "/".join(p for p in (etype, code) if p)
    reason = f"HTTP {status}" + (f" {label}" if label else "")
    should_retry = (headers.get("x-should-retry") or "").lower()
    transient = True if should_retry == "true" else False if should_retry == "false" else None
    kind = _status_kind(status, etype, code, message)
    if kind == ModelFailure.CONTEXT_LENGTH:
        transient = False
        if code != "context_length_exceeded":
            reason += " (prompt is too long)"
    retry_after = (retry_after_s(headers)
                   if kind in (ModelFailure.RATE_LIMITED, ModelFailure.SERVER) else None)
    return ProviderError(kind, reason, status=status, retry_after_s=retry_after,
                         request_id=request_id, transient=transient)


_KIND_OF_STATUS = {401: ModelFailure.AUTH, 403: ModelFailure.AUTH, 404: ModelFailure.NOT_FOUND,
                   408: ModelFailure.TIMEOUT}


def _status_kind(status: int, etype: str | None, code: str | None, message: str
                 ) -> ModelFailure:
    if status in (400, 413) and (code == "context_length_exceeded"
                                 or any(m in message for m in _CONTEXT_MARKERS)):
        return ModelFailure.CONTEXT_LENGTH
    if status == 429:
        quota = code in _QUOTA_CODES or etype in _QUOTA_CODES
        return ModelFailure.QUOTA if quota else ModelFailure.RATE_LIMITED
    if status == 409 or status >= 500:
        return ModelFailure.SERVER
    return _KIND_OF_STATUS.get(status, ModelFailure.BAD_REQUEST)


def retry_after_s(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds the provider asks to wait: ``retry-after-ms``, ``retry-after`` (seconds or an
    HTTP date). None when absent or unreadable."""
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / divisor
        except ValueError:
            if divisor != 1.0:
                continue
            try:
                parsed = email.utils.parsedate_to_datetime(value)
            except (ValueError, TypeError):
                continue
            if parsed.tzinfo is None:
                continue
            seconds = parsed.timestamp() - (time.time() if now is None else now)
        if seconds == seconds and seconds >= 0:  # not NaN
            return seconds
        return 0.0
    return None


def connection_failed() -> ProviderError:
    return ProviderError(ModelFailure.CONNECTION, "cannot connect to the provider")


def timed_out(exc: BaseException) -> ProviderError:
    """What an SDK's timeout error is: a timeout, or a connection that failed without timing
    out (:func:`connection_refused`)."""
    if connection_refused(exc):
        return connection_failed()
    return ProviderError(ModelFailure.TIMEOUT, "the request timed out")


def connection_refused(exc: BaseException) -> bool:
    """Whether a timeout error the SDK raised is a connection that failed without timing out.

    The aiohttp transport reports every aiohttp connection error as a connect timeout: a
    refused connection (its cause an OSError that is no TimeoutError) and a server that closed
    the connection (an aiohttp ``ClientConnectionError`` that is no ``ServerTimeoutError``)
    alike. Only the timeouts themselves are TimeoutErrors there."""
    try:  # a failing request only; the SDK's own transport serves when aiohttp is missing
        from aiohttp import ClientConnectionError
        dropped: tuple[type[BaseException], ...] = (OSError, ClientConnectionError)
    except ImportError:
        dropped = (OSError,)
    seen: BaseException | None = exc.__cause__ or exc.__context__
    for _ in range(6):
        if seen is None:
            return False
        if isinstance(seen, dropped) and not isinstance(seen, TimeoutError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def refused_by_sdk(exc: Exception) -> ProviderError:
    # Raised before anything is sent (an argument the SDK rejects): the request itself is
    # wrong, so it is not retried, and it is not the provider's malformed answer either.
    return ProviderError(ModelFailure.BAD_REQUEST, f"the SDK refused to send the request "
                                        f"({type(exc).__name__})")


def malformed(request_id: str | None) -> ProviderError:
    return ProviderError(ModelFailure.MALFORMED, "the response body is not valid JSON",
                         request_id=request_id)


def _safe(value: Any) -> str | None:
    return value if isinstance(value, str) and _SAFE_CODE.match(value) else None


def _get(mapping: Mapping[str, Any], *keys: str) -> Any:
    value: Any = mapping
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value
