"""The pre-compaction hook: an operator's Python function the worker calls before each run.

``events.pre_compaction: "module:function"`` names it. It is called with a :class:`PreCompaction`
once the run holds the session's lease, and answers None (go on) or a mapping:

- ``{"instructions": ["..."]}``: more focus for this run's summary, checked as any instructions
  (``storage.instructions``) and recorded with the run's;
- ``{"veto": "reason"}``: the run ends at once as ``nothing_to_do``, the reason in its error and
  its journal.

The function may be a coroutine function (awaited on the worker's loop) or a plain one (run in a
daemon thread of its own; while :data:`HUNG_HOOKS_MAX` of those still run past their time, the
process calls it no more until one returns). It gets ``events.hook_timeout_s``, and never more than
:data:`HOOK_SHARE_OF_LEFT` of what is left of the run's deadline (:func:`hook_time_s`), so a hook
that hangs leaves the run the rest. A hook that raises, hangs past its time or answers something
else is the hook's failure, not the run's: the run goes on without it, and the error is in the
run's journal (``compaction/end``'s ``hook``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from compactd.storage.errors import InvalidMessage
from compactd.storage.instructions import check_instructions

# The share of what is left of the run's deadline a hook may take: given all of it, a hook that
# hangs would end the run as cancelled instead of letting it go on without the hook.
HOOK_SHARE_OF_LEFT = 0.25
# Threads of a plain hook still running after their run gave up on them, per process: past
# this, runs go on without calling it, so a hook that always hangs holds this many threads,
# not one per run. The hook's calls within their time are bounded by the runs themselves.
HUNG_HOOKS_MAX = 4
THREAD_NAME = "compactd-pre-compaction-hook"

logger = logging.getLogger(__name__)
_hung_lock = threading.Lock()
_hung = 0


@dataclass(frozen=True, slots=True)
class PreCompaction:
    """What the hook is told about the run about to start."""

    session_id: str
    tenant: str
    run_id: str
    trigger: str
    tokens: int  # the session's pressure now
    instructions: tuple[str, ...]  # what the run was asked to focus on so far


@dataclass(frozen=True, slots=True)
class HookAnswer:
    instructions: tuple[str, ...] = ()
    veto: str | None = None
    error: str | None = None
    journal: dict[str, Any] = field(default_factory=dict)


@functools.cache
def load_hook(entry_point: str) -> Callable[[PreCompaction], Any]:
    """The function ``module:attr.path`` names (imported once per process)."""
    module_name, _, path = entry_point.partition(":")
    target: Any = importlib.import_module(module_name)
    for name in path.split("."):
        target = getattr(target, name)
    if not callable(target):
        raise TypeError(f"{entry_point} is not callable")
    return target


def hook_time_s(timeout_s: float, left_s: float) -> float:
    """How long the hook may take: its ``timeout_s``, within its share of the ``left_s``
    seconds the run has before its deadline."""
    return max(0.0, min(timeout_s, left_s * HOOK_SHARE_OF_LEFT))


async def call_hook(entry_point: str, context: PreCompaction, timeout_s: float) -> HookAnswer:
    """The hook's answer to ``context`` within ``timeout_s``; its failure as ``error``."""
    try:
        hook = load_hook(entry_point)
        if inspect.iscoroutinefunction(hook):
            raw = await asyncio.wait_for(hook(context), timeout_s)
        else:
            raw = await asyncio.wait_for(_in_daemon_thread(hook, context), timeout_s)
        answer = _answer(raw)
    except TimeoutError:
        error = f"the hook did not answer within {timeout_s:g} s"
        return HookAnswer(error=error, journal={"hook": entry_point, "error": error})
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return HookAnswer(error=error, journal={"hook": entry_point, "error": error})
    journal: dict[str, Any] = {"hook": entry_point}
    if answer.instructions:
        journal["instructions"] = list(answer.instructions)
    if answer.veto is not None:
        journal["veto"] = answer.veto
    return HookAnswer(answer.instructions, answer.veto, None, journal)


class HooksHung(Exception):
    """A plain hook's earlier calls still run past their time."""


async def _in_daemon_thread(hook: Callable[[PreCompaction], Any], context: PreCompaction) -> Any:
    """``hook(context)`` in a daemon thread of its own: one that hangs past its time is left to
    itself, and neither the loop's executor (shared with the run's other blocking calls) nor the
    process's exit waits for it (a worker's warm shutdown would hang until the hook returned).
    Refused (:class:`HooksHung`) while :data:`HUNG_HOOKS_MAX` such threads still run."""
    global _hung
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[Any] = loop.create_future()
    copied = contextvars.copy_context()
    given_up = returned = False
    with _hung_lock:
        if _hung >= HUNG_HOOKS_MAX:
            raise HooksHung(f"{_hung} earlier calls of the hook have not returned past their "
                            "time; it is not called until one does")

    def settle(result: Any, error: BaseException | None) -> None:
        if answer.done():  # given up on: the hook's time was up
            return
        if error is None:
            answer.set_result(result)
        else:
            answer.set_exception(error)

    def run() -> None:
        global _hung
        nonlocal returned
        try:
            result, error = copied.run(hook, context), None
        except Exception as exc:
            result, error = None, exc
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: the hook's, not the run's
            result, error = None, RuntimeError(f"the hook raised {type(exc).__name__}")
        with _hung_lock:
            returned = True
            if given_up:
                _hung -= 1
        with contextlib.suppress(RuntimeError):  # the loop closed while the hook ran
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=THREAD_NAME, daemon=True).start()
    try:
        return await answer
    except asyncio.CancelledError:  # its time was up (or the run's)
        with _hung_lock:
            if not returned:
                given_up = True
                _hung += 1
                if _hung == HUNG_HOOKS_MAX:
                    logger.warning("the pre-compaction hook hung %d times: runs go on without "
                                   "it until one of those calls returns", _hung,
                                   extra={"action": "hook.hung"})
        raise


def _answer(raw: Any) -> HookAnswer:
    if raw is None:
        return HookAnswer()
    if not isinstance(raw, Mapping) or set(raw) - {"instructions", "veto"}:
        raise TypeError(f"the hook answered {raw!r:.200}: None or a mapping of instructions "
                        "and veto was expected")
    veto = raw.get("veto")
    if veto is not None and (not isinstance(veto, str) or not veto.strip()):
        raise TypeError("the hook's veto must be a non-empty reason")
    texts = raw.get("instructions") or ()
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("the hook's instructions must be a list of texts")
    try:
        checked = tuple(check_instructions(t) for t in texts)
    except InvalidMessage as exc:
        raise TypeError(f"the hook's instructions: {exc}") from None
    return HookAnswer(instructions=checked, veto=veto)
