"""Flower with compactd's defaults: ``celery -A compactd.worker.app flower``.

Flower 2.x reads its options, later ones winning, from its defaults, ``FLOWER_*`` environment
variables (``FLOWER_BASIC_AUTH=user:password[,user2:password2]``), a ``flowerconfig.py`` in the
current directory (or ``--conf``), and its command line. None of those is compactd's to own, so
this module steps in after all of them have been read: Flower builds its application, the
application imports the app's task modules, and Celery's ``import_modules`` signal calls
:func:`apply_defaults` with every option final. There it

* refuses to start without authentication (basic auth or Flower's OAuth ``--auth``): Flower's
  pages can revoke and terminate tasks and show every task's arguments. Only
  ``COMPACTD_FLOWER_UNAUTHENTICATED=1`` (Flower behind a proxy that authenticates) lifts that.
  A basic-auth entry with an empty user or password (``FLOWER_BASIC_AUTH=":"`` is what
  ``$USER:$PASS`` gives when both are unset, and ``curl -u :`` then gets in) is no
  authentication: it is refused, always;
* shows the exception and kwargs columns on the tasks page unless ``tasks_columns`` was set, so a
  failed ``compaction.run`` shows its failure class and session without a click;
* replaces Tornado's log handler with compactd's (``worker.logs``), one style in every process;
* makes SIGTERM and SIGINT stop Tornado's loop from inside the loop (:func:`_stop_on_signals`),
  where Flower's own SIGTERM handler raises ``SystemExit``, and Python's SIGINT handler
  ``KeyboardInterrupt``, wherever the main thread happens to be.

Persistent mode (``--persistent=True --db=PATH --state_save_interval=MS``) keeps the task list
across Flower restarts; see ops/RUNBOOK.md.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

from celery.signals import import_modules

logger = logging.getLogger(__name__)

ENV_UNAUTHENTICATED = "COMPACTD_FLOWER_UNAUTHENTICATED"
# The failure class is the start of a failed run's exception message (worker.tasks), so it
# belongs on the list; kwargs name the session and trigger.
TASK_COLUMNS = "name,uuid,state,exception,kwargs,received,runtime,worker"
REFUSAL = (
    "compactd: Flower refuses to start without authentication. Set FLOWER_BASIC_AUTH="
    "user:password (or --basic-auth=user:password, or --auth with OAuth), or set "
    f"{ENV_UNAUTHENTICATED}=1 if a proxy in front of Flower authenticates every request.\n")


BLANK_REFUSAL = (
    "compactd: Flower refuses to start: basic-auth entry {n} (FLOWER_BASIC_AUTH, --basic-auth or "
    "flowerconfig.py) has an empty user or password, which lets anyone in. Give every entry "
    "as user:password with both set.\n")


class FlowerUnauthenticated(SystemExit):
    """Flower was asked to start with no authentication configured."""


def running_flower() -> bool:
    """True inside the ``flower`` subcommand of the celery CLI."""
    import click

    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.command is not None and ctx.command.name == "flower"


def authenticated(options: Any) -> bool:
    return bool(options.basic_auth or options.auth)


def blank_entry(basic_auth: Any) -> int | None:
    """The 1-based position of the first basic-auth entry without both a user and a password
    (Flower compares ``user:password`` as a whole, so ``:`` admits ``curl -u :``)."""
    for n, entry in enumerate(basic_auth or (), start=1):
        user, colon, password = str(entry).partition(":")
        if not (user and colon and password):
            return n
    return None


def opted_out(env: Any = None) -> bool:
    value = (os.environ if env is None else env).get(ENV_UNAUTHENTICATED, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def apply_defaults(options: Any, *, env: Any = None) -> None:
    """compactd's defaults on Flower's final options; raises :class:`FlowerUnauthenticated`."""
    blank = blank_entry(options.basic_auth)
    if blank is not None:
        sys.stderr.write(BLANK_REFUSAL.format(n=blank))
        raise FlowerUnauthenticated(2)
    if not authenticated(options):
        if not opted_out(env):
            sys.stderr.write(REFUSAL)
            raise FlowerUnauthenticated(2)
        logger.warning("Flower runs WITHOUT authentication (%s is set)", ENV_UNAUTHENTICATED,
                       extra={"action": "flower.unauthenticated"})
    # Tornado keeps options under dashed names; the default tells "not set" from "set".
    default_columns = options._options["tasks-columns"].default
    if options.tasks_columns == default_columns:
        options.tasks_columns = TASK_COLUMNS


def _use_compactd_logging() -> None:
    from tornado.log import LogFormatter

    from compactd.worker import logs
    from compactd.worker.settings import load_config

    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler.formatter, LogFormatter):
            root.removeHandler(handler)
    config = load_config()
    logs.configure(config.log_format, config.log_level)


def _stop_on_signals() -> None:
    """Flower's SIGTERM handler (``flower.command.sigterm_handler``, installed once its app is
    built) raises ``SystemExit`` at whatever line the main thread is running, and Python's
    SIGINT handler raises ``KeyboardInterrupt`` the same way. Early in start-up that is often
    ``ThreadPoolExecutor.submit`` between starting a worker thread and registering it for the
    interpreter's exit: nothing then tells that thread to stop, the exit waits for it, and the
    process outlives the signal until it is killed. Flower installs whatever that module name
    holds when it gets there, so compactd's handler goes under the name, and takes SIGINT too
    (unless the process was started with SIGINT ignored): it only asks Tornado's loop to stop,
    start-up finishes its step, the loop stops on its first turn (or its next one when already
    running), and the exit finds every thread registered."""
    from flower import command
    from tornado.ioloop import IOLoop
    from tornado.platform.asyncio import BaseAsyncIOLoop

    # Flower's loop: its app takes the current one before importing the task modules.
    loop = IOLoop.current()
    assert isinstance(loop, BaseAsyncIOLoop)

    def stop(name: str) -> None:
        logger.info("%s: Flower stops", name, extra={"action": "flower.stop"})
        loop.stop()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        loop.asyncio_loop.call_soon_threadsafe(stop, signal.Signals(signum).name)

    command.sigterm_handler = on_signal
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_signal)


@import_modules.connect
def _on_import_modules(sender: Any = None, **_: Any) -> None:
    if not running_flower():
        return
    from flower.options import options

    _use_compactd_logging()
    apply_defaults(options)
    _stop_on_signals()
