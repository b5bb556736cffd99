"""A range too small to shrink, through a real worker: the kept tail holds nearly all of the
session, the range before it is a few short turns, and the model's summary (every section
compactd's instruction asks for) comes out larger than that range. The run is refused nothing:
it ends with nothing to do, not failed; the surface is as it was and the log replays."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from compactd.worker.compaction.prompt import SECTIONS
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

# A few short turns (about 150 tokens in all), then a tail of two long tool-less messages.
HEAD = [m for i in range(3) for m in (
    {"role": "user", "content": f"Turn {i}: is order {i} shipped yet?"},
    {"role": "assistant", "content": f"Order {i} left the warehouse this morning."})]
TAIL = [{"role": "user", "content": "Here is the full manifest: " + "crate, pallet, box. " * 400},
        {"role": "assistant", "content": "Noted the manifest. " + "Checked line ok. " * 400}]
# A valid summary of compactd's sections, each with a line: larger than HEAD.
SUMMARY = "\n".join(f"## {name}\n- the customer asked about orders 0, 1 and 2 and each has "
                    f"shipped; nothing else is pending for {name.lower()}." for name in SECTIONS)


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


def test_a_range_too_small_to_shrink_ends_the_run_with_nothing_to_do(
        make_stack: Callable[..., Stack], fake: FakeProvider, db: Db) -> None:
    fake.script(Behaviour(model="fake-gpt", output="text", text=SUMMARY, times=-1))
    stack = make_stack(summarization={"keep": {"type": "messages", "value": len(TAIL)}},
                       worker={"local_fallback": False})
    sid = "small-range"
    db.run(lambda s: s.create_session(sid, run_model="fake-gpt", context_window=128_000))
    db.ingest(sid, [*HEAD, *TAIL], run_model="fake-gpt")
    before = stack.cli_json("surface", sid)
    stack.start_worker("w1", concurrency=1)

    result = stack.cli_json("compact", sid, "--wait", "--keep", f"messages:{len(TAIL)}")

    # The model was asked once and its summary was refused as not smaller than the range: the
    # run ends with nothing to do, saying why, and is not a failed run.
    assert len(fake.requests) == 1, [r.model for r in fake.requests]
    assert result["outcome"] == "nothing_to_do", result
    [run] = stack.cli_json("status", sid)["runs"]
    assert run["status"] == "nothing_to_do", run
    assert "too small to shrink" in (run["error"] or ""), run
    assert stack.cli_json("surface", sid) == before
    assert stack.cli("verify", sid).returncode == 0
