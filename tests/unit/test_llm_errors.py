"""Error classification and backoff: pure functions, one table each."""

from __future__ import annotations

import random

import pytest

from compactd.worker.llm.fallback import compute_backoff
from compactd.worker.llm.http_errors import retry_after_s, status_error


@pytest.mark.parametrize(("status", "headers", "error", "kind", "transient"), [
    (400, {}, {"type": "invalid_request_error", "code": "context_length_exceeded",
               "message": "This model's maximum context length is 128000 tokens."},
     "context_length", False),
    (400, {}, {"type": "invalid_request_error",
               "message": "prompt is too long: 210000 tokens > 200000 maximum"},
     "context_length", False),
    (400, {}, {"type": "invalid_request_error", "message": "temperature must be <= 2"},
     "bad_request", False),
    (401, {}, {"type": "authentication_error"}, "auth", False),
    (403, {}, {"type": "permission_error"}, "auth", False),
    (404, {}, {"code": "model_not_found"}, "not_found", False),
    (408, {}, {}, "timeout", True),
    (409, {}, {}, "server", True),
    (413, {}, {"type": "request_too_large", "message": "input is too long"},
     "context_length", False),
    (422, {}, {}, "bad_request", False),
    (429, {"retry-after": "7"}, {"type": "rate_limit_error"}, "rate_limited", True),
    (429, {}, {"code": "insufficient_quota"}, "quota", False),
    (500, {}, {"type": "api_error"}, "server", True),
    (503, {}, {}, "server", True),
    (529, {}, {"type": "overloaded_error"}, "server", True),
    # The provider's own verdict wins: x-should-retry.
    (500, {"x-should-retry": "false"}, {}, "server", False),
    (400, {"x-should-retry": "true"}, {}, "bad_request", True),
])
def test_status_error(status: int, headers: dict[str, str], error: dict[str, str], kind: str,
                      transient: bool) -> None:
    exc = status_error(status, headers, error, request_id="req_1")
    assert (exc.kind, exc.transient, exc.status, exc.request_id) == (
        kind, transient, status, "req_1")


def test_reasons_never_copy_the_provider_message() -> None:
    exc = status_error(400, {}, {"type": "invalid_request_error",
                                 "message": "your prompt said: SECRET PROMPT TEXT"},
                       request_id=None)
    assert "SECRET" not in exc.reason and "SECRET" not in str(exc)
    odd = status_error(400, {}, {"type": "a type with spaces and <html>"}, request_id=None)
    assert odd.reason == "HTTP 400"


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, None),
    ({"retry-after": "3"}, 3.0),
    ({"retry-after": "0.25"}, 0.25),
    ({"retry-after-ms": "1500"}, 1.5),
    ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
    ({"retry-after": "soon"}, None),
    ({"retry-after": "-4"}, 0.0),
    ({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, 10.0),
])
def test_retry_after(headers: dict[str, str], expected: float | None) -> None:
    now = 1445412480.0  # 07:28:00 that day
    assert retry_after_s(headers, now=now) == expected


def test_backoff_doubles_up_to_its_cap_without_jitter() -> None:
    waits = [compute_backoff(n, initial_s=0.5, max_s=4, jitter=False) for n in range(1, 7)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_backoff_jitter_is_deterministic_by_argument_and_bounded() -> None:
    a = [compute_backoff(n, initial_s=1, max_s=8, rng=random.Random(3)) for n in range(1, 6)]
    b = [compute_backoff(n, initial_s=1, max_s=8, rng=random.Random(3)) for n in range(1, 6)]
    assert a == b
    for n, wait in enumerate(a, start=1):
        full = min(8, 2 ** (n - 1))
        assert full / 2 <= wait <= full
