"""``compactd serve`` as a real process on PostgreSQL and Redis: one tenant cannot stall or flood
the others, and the server holds nothing open for a client that stops sending."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.support.api import TOKEN_A, TOKEN_B, bearer, start_api

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

TOOL_RESULTS = 60
RESULT_CHARS = 64_000
WORDS = ("the", "build", "failed", "in", "module", "billing", "because", "the", "rounding",
         "test", "expected", "42", "cents")


def big_step() -> list[dict[str, object]]:
    """One agent step of large tool results: a body near the 4 MiB default limit, about 0.7M
    tokens to count, few rows to write."""
    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(RESULT_CHARS // 6))
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "read_file", "arguments": json.dumps({"n": i})}}
             for i in range(TOOL_RESULTS)]
    return [{"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": f"c{i}", "content": f"{i} {text}"}
              for i in range(TOOL_RESULTS))]


def test_another_tenant_is_answered_while_a_4_mb_append_is_counted(
        make_stack) -> None:  # type: ignore[no-untyped-def]
    # The trigger is out of reach: nothing is queued, no worker is needed.
    stack = make_stack(summarization={"trigger": [{"type": "tokens", "value": 1_000_000_000}]})
    url = start_api(stack)
    body = json.dumps({"messages": big_step()}).encode()
    assert 3_500_000 < len(body) < 4 * 1024 * 1024
    with httpx.Client(base_url=url, timeout=600) as http:
        for token, session in ((TOKEN_A, "a-big"), (TOKEN_B, "b-small")):
            assert http.put(f"/v1/sessions/{session}", headers=bearer(token),
                            json={"run_model": "gpt-4o"}).status_code == 201

    in_flight = threading.Event()
    outcome: dict[str, object] = {}

    def tenant_a() -> None:
        with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=600) as http:
            in_flight.set()
            started = time.monotonic()
            answer = http.post("/v1/sessions/a-big/messages", content=body,
                               headers={"Content-Type": "application/json"})
            outcome["took_s"] = time.monotonic() - started
            in_flight.clear()
            outcome["answer"] = answer

    a = threading.Thread(target=tenant_a)
    a.start()
    in_flight.wait(30)
    during: list[float] = []
    with httpx.Client(base_url=url, headers=bearer(TOKEN_B), timeout=600) as http:
        n = 0
        while a.is_alive():
            started = time.monotonic()
            step = http.post("/v1/sessions/b-small/messages",
                             json={"messages": [{"role": "user", "content": f"b{n}"}]})
            assert step.status_code == 200, step.text
            took = time.monotonic() - started
            if in_flight.is_set():
                during.append(took)
            n += 1
    a.join()
    answer = outcome["answer"]
    assert isinstance(answer, httpx.Response) and answer.status_code == 200, answer
    assert answer.json()["messages"] == TOOL_RESULTS + 1
    took_s = float(outcome["took_s"])  # type: ignore[arg-type]
    # Not a latency goal (tests/bench/tenant_latency.py measures that): on the code that decoded
    # and counted on the event loop, one of B's requests waited out nearly all of A's append;
    # off the loop B waits for its turns of the GIL, a small part of it (measured on a loaded
    # 2-core VM: 0.64 and 0.73 of A's time before, 0.07 and 0.09 after).
    assert len(during) >= 3, f"B got {len(during)} answers during A's {took_s:.1f} s append"
    assert max(during) < took_s / 3, (
        f"B waited up to {max(during):.2f} s during A's {took_s:.1f} s append")


def test_a_body_shorter_than_its_content_length_is_408_after_the_body_timeout(
        make_stack) -> None:  # type: ignore[no-untyped-def]
    import socket
    from urllib.parse import urlparse

    stack = make_stack()
    url = start_api(stack, api={"body_timeout_s": 1})
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=30) as http:
        assert http.put("/v1/sessions/s1", json={}).status_code == 201
    address = urlparse(url)
    head = (f"POST /v1/sessions/s1/messages HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Authorization: Bearer {TOKEN_A}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n").encode()
    with socket.create_connection((address.hostname, address.port), timeout=30) as raw:
        raw.sendall(head + b'{"messages": [{"role": "user", "content": "hel')
        answer = b""
        while chunk := raw.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", answer[:500]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"] == "timeout" and "api.body_timeout_s" in body["message"], body
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=30) as http:
        assert http.get("/v1/sessions/s1").json()["messages"] == 0
        # A body that arrives in time is served as before.
        step = http.post("/v1/sessions/s1/messages",
                         json={"messages": [{"role": "user", "content": "hello"}]})
        assert step.status_code == 200, step.text


def test_the_served_api_has_no_interactive_docs_unless_asked_and_serves_openapi_json(
        make_stack) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack()
    url = start_api(stack)
    assert httpx.get(f"{url}/docs", timeout=30).status_code == 404
    assert httpx.get(f"{url}/redoc", timeout=30).status_code == 404
    assert httpx.get(f"{url}/openapi.json", timeout=30).json()["info"]["title"] == "compactd"
