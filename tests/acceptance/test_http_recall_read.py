"""``compactd serve`` as a real process on PostgreSQL: reading back a compacted original of
several megabytes does not stall another tenant's appends."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.support.api import TOKEN_A, TOKEN_B, appends_while, bearer, start_api

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis, pytest.mark.timed]

LINE_WORDS = ("volume", "quota", "mount", "retry", "backup", "ledger", "cursor", "shard")
# Tenant B's appends while A reads. On the code that rendered and counted a page on the event
# loop, one read of a page of this original held every request 2.1 s; off the loop, B waits
# for its turns of the GIL.
APPEND_WAIT_S = 0.5


def test_another_tenant_appends_while_a_3_mb_original_is_read_page_by_page(
        make_stack) -> None:  # type: ignore[no-untyped-def]
    # The trigger is out of reach: the one compaction is the forced one below.
    stack = make_stack(summarization={"trigger": [{"type": "tokens", "value": 1_000_000_000}],
                                      "keep": {"type": "messages", "value": 2}})
    line = " ".join(LINE_WORDS[(i * 5) % 7] for i in range(3_000_000 // 6))
    assert len(line) > 3_000_000 and "\n" not in line
    path = stack.home / "a-big.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in [
        {"role": "user", "content": "Dump the volume log."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "read_log", "arguments": '{"path": "volume.log"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": line},
        {"role": "assistant", "content": "The log is one long line."},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "Done."}]))
    stack.cli("ingest", str(path), "--session", "a-big", "--tenant", "tenant-a",
              "--run-model", "gpt-4o")
    outcome = stack.cli_json("compact", "a-big", "--force", "--inline", timeout=600)
    assert outcome["outcome"] == "committed", outcome
    url = start_api(stack)
    with httpx.Client(base_url=url, timeout=600) as http:
        assert http.put("/v1/sessions/b-small", headers=bearer(TOKEN_B),
                        json={"run_model": "gpt-4o"}).status_code == 201

    reading = threading.Event()
    pages: list[float] = []
    failures: list[str] = []

    def tenant_a() -> None:
        with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=600) as http:
            reading.set()
            started = time.monotonic()
            params: dict[str, object] = {"checkpoint": "r3"}
            # At least three pages, and for at least two seconds.
            while len(pages) < 3 or time.monotonic() - started < 2:
                began = time.monotonic()
                page = http.get("/v1/sessions/a-big/history/read", params=params)
                pages.append(time.monotonic() - began)
                if page.status_code != 200:
                    failures.append(page.text)
                    break
                body = page.json()
                assert body["seqs"] == [3] and body["tokens"] <= 2000, body["seqs"]
                params = {"checkpoint": "r3", "cursor": body["cursor"]}
            reading.clear()

    a = threading.Thread(target=tenant_a)
    a.start()
    reading.wait(30)
    during = appends_while(url, TOKEN_B, "b-small", a, reading)
    a.join()
    assert not failures, failures
    assert len(during) >= 3, f"B got {len(during)} answers during A's {len(pages)} pages"
    assert max(during) < APPEND_WAIT_S, (
        f"B waited up to {max(during):.2f} s while A read pages of {pages}")
