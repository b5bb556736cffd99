"""The recall routes over HTTP (in process, lifespan included) on PostgreSQL and SQLite:
search and read what a real compaction replaced, tenant isolation, bad input answered 4xx
naming the argument with nothing written, and ``GET /v1/tools``."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from compactd.storage.recall import encode_cursor
from compactd.storage.recall_bounds import MAX_SEARCH_LIMIT
from compactd.storage.store import Store
from compactd.worker.compaction.recall_tools import tools_document
from tests.support.asgi import A, B, Served, api_config, serve_app
from tests.support.recall_sample import NEEDLE, compacted_sample
from tests.support.tables import row_counts


@pytest.fixture
async def api(db_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    config = api_config(db_url, tmp_path, broker_url="memory://")
    await compacted_sample(db_url, (("a-session", "tenant-a"), ("b-session", "tenant-b")))
    async for served in serve_app(config):
        yield served


def _store(api: Served) -> Store:
    store: Store = api.app.state.api.store
    return store


async def _search(api: Served, session: str, headers: dict[str, str] = A,
                  **params: Any) -> Any:
    return await api.http.get(f"/v1/sessions/{session}/history/search", headers=headers,
                              params=params)


async def _read(api: Served, session: str, headers: dict[str, str] = A, **params: Any) -> Any:
    return await api.http.get(f"/v1/sessions/{session}/history/read", headers=headers,
                              params=params)


async def test_search_then_read_pages_back_the_dropped_fact(api: Served) -> None:
    found = await _search(api, "a-session", query=NEEDLE)
    assert found.status_code == 200, found.text
    body = found.json()
    top = body["hits"][0]
    assert body["session"] == "a-session" and top["exact"] and NEEDLE in top["snippet"]
    assert body["scanned"]["messages"] > 0
    transcript, params, pages = "", {"checkpoint": top["checkpoint"]}, 0
    while True:
        page = await _read(api, "a-session", **params)
        assert page.status_code == 200, page.text
        pages += 1
        transcript += page.json()["transcript"]
        if page.json()["cursor"] is None:
            break
        params = {"checkpoint": top["checkpoint"], "cursor": page.json()["cursor"]}
    assert NEEDLE in transcript and pages >= 1
    scoped = await _search(api, "a-session", query=NEEDLE, checkpoint=top["checkpoint"],
                           limit=1)
    assert [h["seq"] for h in scoped.json()["hits"]] == [top["seq"]]
    # an offset is a message index into the same originals
    second = await _read(api, "a-session", checkpoint=top["checkpoint"], offset=1)
    assert second.status_code == 200 and second.json()["offset"] == 1


async def test_another_tenants_session_or_checkpoint_is_404(api: Served) -> None:
    own = (await _search(api, "b-session", B, query=NEEDLE)).json()["hits"][0]
    for response in (await _search(api, "b-session", A, query=NEEDLE),
                     await _read(api, "b-session", A, checkpoint=own["checkpoint"]),
                     await _search(api, "no-such-session", A, query=NEEDLE)):
        assert response.status_code == 404, response.text
        assert response.json()["error"] == "not_found"
        assert NEEDLE not in response.text and "tenant-b" not in response.text
    # B's checkpoint name asked of A's own session reads A's node of that name or none: never
    # B's rows. A name A's session lacks is 404.
    missing = await _read(api, "a-session", A, checkpoint="c999999-1000000")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    assert "c999999-1000000" in missing.json()["message"]


async def test_bad_input_is_4xx_naming_the_argument_and_writes_nothing(api: Served) -> None:
    ref = (await _search(api, "a-session", query=NEEDLE)).json()["hits"][0]["checkpoint"]
    pruned = [h["checkpoint"] for h in (await _search(api, "a-session", query="the",
                                                      limit=MAX_SEARCH_LIMIT)).json()["hits"]
              if h["checkpoint"] != ref]
    page = (await _read(api, "a-session", checkpoint=ref)).json()
    before = await row_counts(_store(api))
    cases: list[tuple[Any, int, str | None]] = [
        (_search(api, "a-session", query=""), 422, "query.query"),
        (_search(api, "a-session", query="x" * 10_240), 422, "query.query"),
        (_search(api, "a-session"), 422, "query.query"),
        (_search(api, "a-session", query="x", limit=MAX_SEARCH_LIMIT + 1), 422, "query.limit"),
        (_search(api, "a-session", query="x", limit=0), 422, "query.limit"),
        (_search(api, "a-session", query="x", limit="five"), 422, "query.limit"),
        (_search(api, "a-session", query="x", checkpoint="r424242"), 404, None),
        (_read(api, "a-session", checkpoint="c999999-1000000"), 404, None),
        (_read(api, "a-session", checkpoint=ref, offset=-1), 422, "query.offset"),
        (_read(api, "a-session", checkpoint=ref, cursor="garbage"), 422, "query.cursor"),
        (_read(api, "a-session", checkpoint=ref, offset=0, cursor="x"), 422, "query.cursor"),
        (_read(api, "a-session"), 422, "query.checkpoint"),
        (_read(api, "a-session", checkpoint="not-a-ref"), 422, "query.checkpoint"),
        (_read(api, "a-session", checkpoint="c1-2\x00"), 422, "query.checkpoint"),
        (_search(api, "a-session", query="x", checkpoint="c5-1"), 422, "query.checkpoint"),
        (_search(api, "a-session", query="x\x00"), 422, "query.query"),
        (_read(api, "a-session", checkpoint=ref, budget_tokens=63), 422, "query.budget_tokens"),
        (_read(api, "a-session", checkpoint=ref, budget_tokens=100_001), 422,
         "query.budget_tokens"),
        (_read(api, "a-session", checkpoint=ref, budget_tokens="lots"), 422,
         "query.budget_tokens"),
    ]
    # a cursor of one checkpoint given with another
    assert page["cursor"] is not None, "the checkpoint fits one page: nothing to test"
    other = pruned[0] if pruned else "r1"
    cases.append((_read(api, "a-session", checkpoint=other, cursor=page["cursor"]),
                  422, "query.cursor"))
    for call, status, field in cases:
        response = await call
        assert response.status_code == status, response.text
        body = response.json()
        assert body["message"] and body["field"] == field, body
        if field is not None:
            assert body["error"] == "invalid"
            assert field.removeprefix("query.") in body["message"]
    assert await row_counts(_store(api)) == before


async def test_budget_tokens_bounds_the_page(api: Served) -> None:
    ref = (await _search(api, "a-session", query=NEEDLE)).json()["hits"][0]["checkpoint"]
    small = (await _read(api, "a-session", checkpoint=ref, budget_tokens=64)).json()
    default = (await _read(api, "a-session", checkpoint=ref)).json()
    whole = (await _read(api, "a-session", checkpoint=ref, budget_tokens=100_000)).json()
    assert small["tokens"] <= 64 < default["tokens"] <= 2000 < whole["tokens"]
    assert small["cursor"] is not None and whole["cursor"] is None
    # the cursor of a small page resumes with any budget
    following = await _read(api, "a-session", checkpoint=ref, cursor=small["cursor"],
                            budget_tokens=100_000)
    assert following.status_code == 200
    assert small["transcript"] + following.json()["transcript"] == whole["transcript"]


async def test_tools_lists_both_forms_and_takes_a_token(api: Served) -> None:
    response = await api.http.get("/v1/tools", headers=A)
    assert response.status_code == 200
    assert response.json() == tools_document()
    names = {t["function"]["name"] for t in response.json()["openai"]}
    assert names == {t["name"] for t in response.json()["anthropic"]} == {
        "history_search", "history_read", "compact_context"}
    assert (await api.http.get("/v1/tools")).status_code == 401


async def test_paging_by_offset_always_moves_on_and_ends(api: Served) -> None:
    """A page that ends inside its first message cannot name that message again as the next
    offset: a client paging by offset would read it forever."""
    ref = (await _search(api, "a-session", query=NEEDLE)).json()["hits"][0]["checkpoint"]
    whole = (await _read(api, "a-session", checkpoint=ref, budget_tokens=100_000)).json()
    offsets, offset, cut = [], 0, 0
    for _ in range(whole["total_messages"] + 1):
        page = (await _read(api, "a-session", checkpoint=ref, offset=offset,
                            budget_tokens=64)).json()
        offsets.append(offset)
        cut += page["cursor"] is not None and _cursor_position(page["cursor"])[1] > 0
        if page["next_offset"] is None:
            break
        assert page["next_offset"] > offset, page
        offset = page["next_offset"]
    else:
        raise AssertionError(f"paging by offset did not end: {offsets}")
    # every message was begun on some page, and some pages were cut inside one
    assert offsets == sorted(set(offsets)) and cut > 0
    assert len(offsets) <= whole["total_messages"]


async def test_a_cursor_edited_past_its_message_or_the_last_one_is_refused(api: Served) -> None:
    ref = (await _search(api, "a-session", query=NEEDLE)).json()["hits"][0]["checkpoint"]
    page = (await _read(api, "a-session", checkpoint=ref, budget_tokens=64)).json()
    assert page["cursor"] is not None
    index, within = _cursor_position(page["cursor"])
    total = page["total_messages"]
    before = await row_counts(_store(api))
    for edited in (encode_cursor(ref, index, within + 10_000_000),
                   encode_cursor(ref, total, 0), encode_cursor(ref, total + 5, 3)):
        refused = await _read(api, "a-session", checkpoint=ref, cursor=edited)
        assert refused.status_code == 422, refused.text
        body = refused.json()
        assert body["field"] == "query.cursor" and "past" in body["message"], body
    assert await row_counts(_store(api)) == before
    # the cursor as returned still reads on
    assert (await _read(api, "a-session", checkpoint=ref, cursor=page["cursor"])
            ).status_code == 200


def _cursor_position(cursor: str) -> tuple[int, int]:
    body = cursor.removeprefix("hr1.")
    _, index, within = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode(
        ).rsplit(":", 2)
    return int(index), int(within)
