"""worker.hooks: what the pre-compaction hook may answer, and how its failures are reported (the
worker's use of it is tests/acceptance/test_pre_compaction_hook.py)."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from compactd.worker.hooks import (
    HUNG_HOOKS_MAX,
    THREAD_NAME,
    PreCompaction,
    call_hook,
    load_hook,
)

CONTEXT = PreCompaction(session_id="s1", tenant="acme", run_id="r1", trigger="manual",
                        tokens=1234, instructions=("keep the plan",))
BAD_ANSWERS = [
    ("go on", "the hook answered 'go on': None or a mapping"),
    ({"skip": True}, "the hook answered {'skip': True}"),
    ({"veto": ""}, "the hook's veto must be a non-empty reason"),
    ({"veto": 3}, "the hook's veto must be a non-empty reason"),
    ({"instructions": "one text"}, "the hook's instructions must be a list of texts"),
    ({"instructions": [""]}, "the hook's instructions: field 'instructions': is empty"),
]


@pytest.fixture
def hooks() -> Iterator[Any]:
    module = types.ModuleType("compactd_unit_hooks")
    for index, (answer, _) in enumerate(BAD_ANSWERS):
        setattr(module, f"bad{index}", lambda run, answer=answer: answer)

    async def asks(run: PreCompaction) -> dict[str, Any]:
        return {"instructions": [f"{run.tenant}: {run.tokens} tokens"]}

    async def hangs(run: PreCompaction) -> None:
        await asyncio.sleep(30)

    def blocks(run: PreCompaction) -> None:
        module.thread = threading.current_thread()
        module.release.wait(60)

    module.asks, module.hangs, module.blocks = asks, hangs, blocks
    module.release = threading.Event()
    sys.modules[module.__name__] = module
    load_hook.cache_clear()  # an earlier test's module, its functions bound to its release
    yield module
    module.release.set()
    del sys.modules[module.__name__]


@pytest.mark.parametrize("index", range(len(BAD_ANSWERS)))
async def test_an_answer_that_is_not_one_is_the_hooks_error(hooks: Any, index: int) -> None:
    out = await call_hook(f"compactd_unit_hooks:bad{index}", CONTEXT, 1.0)
    assert out.veto is None and out.instructions == ()
    assert out.error is not None
    assert out.error.startswith("TypeError: " + BAD_ANSWERS[index][1]), out.error
    assert out.journal == {"hook": f"compactd_unit_hooks:bad{index}", "error": out.error}


async def test_a_coroutine_hook_is_awaited_and_bounded(hooks: Any) -> None:
    asked = await call_hook("compactd_unit_hooks:asks", CONTEXT, 1.0)
    assert asked.error is None and asked.instructions == ("acme: 1234 tokens",)
    hung = await call_hook("compactd_unit_hooks:hangs", CONTEXT, 0.05)
    assert hung.error == "the hook did not answer within 0.05 s"


async def test_a_hook_that_cannot_be_loaded_is_its_error() -> None:
    missing = await call_hook("compactd_no_such_module:before", CONTEXT, 1.0)
    assert missing.error == "ModuleNotFoundError: No module named 'compactd_no_such_module'"




async def test_a_plain_hook_that_hangs_never_holds_the_process_at_its_exit(hooks: Any) -> None:
    hung = await call_hook("compactd_unit_hooks:blocks", CONTEXT, 0.05)
    assert hung.error == "the hook did not answer within 0.05 s"
    # Still running after the run went on: in a daemon thread, which the interpreter does not
    # wait for at exit (a worker's warm shutdown would wait on the pool's thread until the
    # hook returned).
    assert hooks.thread.is_alive() and hooks.thread.daemon


def hook_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


async def test_a_plain_hook_that_always_hangs_holds_a_bounded_number_of_threads(
        hooks: Any) -> None:
    for thread in hook_threads():  # another test's, released by its teardown
        thread.join(5)
    answers = [await call_hook("compactd_unit_hooks:blocks", CONTEXT, 0.01)
               for _ in range(HUNG_HOOKS_MAX + 3)]
    assert len(hook_threads()) == HUNG_HOOKS_MAX
    assert {a.error for a in answers[:HUNG_HOOKS_MAX]} == {
        "the hook did not answer within 0.01 s"}
    for refused in answers[HUNG_HOOKS_MAX:]:
        assert refused.error == (f"HooksHung: {HUNG_HOOKS_MAX} earlier calls of the hook have "
                                 "not returned past their time; it is not called until one does")
    hooks.release.set()
    for thread in hook_threads():
        thread.join(5)
    # Once they returned, the hook is called again.
    again = await call_hook("compactd_unit_hooks:blocks", CONTEXT, 1.0)
    assert again.error is None

