"""The worker's operational plumbing without processes: metrics created once under concurrent
first use, no metrics endpoint under prefork, the log context of a task, the metrics port from
the environment."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import io
import json
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import compactd.worker.metrics as metrics_module
from compactd.worker import logs
from compactd.worker.settings import ModelSpec, load_config


def test_concurrent_first_use_creates_the_metrics_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    real = metrics_module.Metrics

    def slow_metrics() -> metrics_module.Metrics:
        time.sleep(0.05)  # widen the window between "is it there?" and "register it"
        return real(registry)

    monkeypatch.setattr(metrics_module, "_metrics", None)
    monkeypatch.setattr(metrics_module, "Metrics", slow_metrics)
    start = threading.Barrier(16)
    got: list[Any] = []
    errors: list[BaseException] = []

    def first_use() -> None:
        start.wait()
        try:
            got.append(metrics_module.metrics())
        except BaseException as exc:  # a duplicate registration raises ValueError
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(got) == 16 and len({id(m) for m in got}) == 1


class _Sender:
    """What Celery's worker_ready passes: the consumer, with its pool and its app (whose conf
    carries no compactd config here, so the environment's is read)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.app = SimpleNamespace(conf=SimpleNamespace())


@pytest.mark.parametrize("pool_module, serves", [("celery.concurrency.thread", True),
                                                 ("celery.concurrency.prefork", False)])
def test_the_endpoint_is_served_for_the_threads_pool_only(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, pool_module: str,
        serves: bool) -> None:
    import importlib

    import compactd.worker.tasks as tasks

    pool_cls = importlib.import_module(pool_module).TaskPool
    served: list[int] = []
    monkeypatch.setattr(tasks, "serve", served.append)
    monkeypatch.setenv("COMPACTD_METRICS_PORT", "19540")
    caplog.set_level(logging.ERROR, logger="compactd.worker.tasks")
    tasks._on_ready(sender=_Sender(pool_cls.__new__(pool_cls)))
    assert served == ([19540] if serves else [])
    assert bool(caplog.records) is not serves
    if not serves:
        assert "prefork" in caplog.records[0].getMessage()


def test_metrics_port_env_overrides_the_file(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  metrics_port: 9600\n")
    assert load_config({}, path=str(path)).worker.metrics_port == 9600
    assert load_config({"COMPACTD_METRICS_PORT": "9601"}, path=str(path)).worker.metrics_port \
        == 9601
    assert load_config({"COMPACTD_METRICS_PORT": "0"}).worker.metrics_port == 0
    with pytest.raises(Exception, match="metrics_port"):
        load_config({"COMPACTD_METRICS_PORT": "70000"})


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    logs.configure(fmt, "INFO", stream=stream)
    return logging.getLogger("compactd.test"), stream


@pytest.fixture
def restore_logging() -> Any:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_task_context_carries_the_run_id_until_postrun(restore_logging: None) -> None:
    log, stream = _capture("json")
    token = logs.push(session_id="s1", task_id="t1")  # task_prerun
    log.info("claimed")
    logs.bind_more(run_id="r1")  # the run is known
    log.info("Task compaction.run[t1] succeeded")
    logs.pop(token)  # task_postrun
    log.info("next task")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x.get("session_id"), x.get("task_id"), x.get("run_id")) for x in lines] == [
        ("s1", "t1", None), ("s1", "t1", "r1"), (None, None, None)]


def test_text_on_a_terminal_json_otherwise(restore_logging: None) -> None:
    log, stream = _capture("text")
    with logs.bind(session_id="s1", run_id="r1"):
        log.info("compaction committed", extra={"action": "compaction.end"})
    line = stream.getvalue().strip()
    assert line.endswith("compaction committed  [action=compaction.end session_id=s1 run_id=r1]")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    logs.configure("auto", "INFO", stream=tty)
    logging.getLogger("compactd.test").info("hello")
    logs.configure("auto", "INFO", stream=pipe)
    logging.getLogger("compactd.test").info("hello")
    assert "INFO" in tty.getvalue() and not tty.getvalue().startswith("{")
    assert json.loads(pipe.getvalue())["msg"] == "hello"


@pytest.mark.parametrize(("configured", "expected", "kept"),
                         [(None, 20, 10), (7, 7, 3), (2, 2, 1), (1, 1, 0)])
def test_a_worker_keeps_db_pool_size_connections_and_opens_no_more(
        tmp_path: Any, configured: int | None, expected: int, kept: int) -> None:
    """Connections a pool opens over its size are closed on return: under load the worker spent
    ~10% of its CPU reconnecting. Half of them are kept checked out for the statements every
    compaction runs, and at least one is left for the transactions, which never use a kept
    one (a pool of 1 keeps none). (Building the engine opens no connection.)"""
    from compactd.worker.runtime import build_deps
    from compactd.worker.settings import WorkerConfig

    config = load_config({"COMPACTD_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
                          "COMPACTD_HOME": str(tmp_path)})
    if configured is not None:
        config = dataclasses.replace(config, worker=WorkerConfig(db_pool_size=configured))

    async def pool_of_a_worker() -> tuple[int, int, int]:
        deps = await build_deps(config)
        try:
            pool: Any = deps.store.engine.sync_engine.pool
            return pool.size(), pool._max_overflow, deps.store.db._kept.capacity
        finally:
            await deps.aclose()

    assert asyncio.run(pool_of_a_worker()) == (expected, 0, kept)


def test_a_worker_collects_garbage_less_often_and_never_rescans_startup_objects() -> None:
    from compactd.worker.runtime import tune_gc
    from compactd.worker.settings import WorkerConfig

    assert WorkerConfig().gc_threshold == 10_000
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        tune_gc(0)  # Python's own collector, untouched
        assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
        tune_gc(12_345)
        assert gc.get_threshold() == (12_345, before[1], before[2])
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_starting_worker_applies_its_configured_gc_threshold(tmp_path: Any) -> None:
    from compactd.worker.settings import WorkerConfig
    from compactd.worker.tasks import _prepare_process

    config = load_config({"COMPACTD_HOME": str(tmp_path)})  # the local summarizer: no SDK
    config = dataclasses.replace(config, worker=WorkerConfig(gc_threshold=23_456))
    sender = SimpleNamespace(app=SimpleNamespace(conf=SimpleNamespace(compactd_config=config)))
    before = gc.get_threshold()
    try:
        _prepare_process(sender=sender)  # what Celery's worker_init runs
        assert gc.get_threshold()[0] == 23_456
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_task_returns_the_outcome_at_a_glance_not_the_whole_run() -> None:
    """Celery renders a task's return value for its log line and its event: the replaced seqs
    and the candidates' attempts stay in the run row."""
    from compactd.worker.run import Outcome

    outcome = Outcome("s1", "r1", "failed", "summary", trigger="sweep", tokens_before=9000,
                      replaced_seqs=list(range(200)), error="every candidate failed",
                      candidates=[{"candidate": "m", "kind": "empty"}] * 3)
    brief = outcome.brief()
    assert brief["outcome"] == "failed" and brief["failure_class"] == "summary"
    assert brief["error"] == "every candidate failed" and brief["session"] == "s1"
    assert "replaced_seqs" not in brief and "candidates" not in brief
    assert len(repr(brief)) < len(repr(outcome.to_json())) / 2


def test_a_worker_runs_uvloop_unless_told_otherwise(tmp_path: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop costs a worker less CPU per compaction; asyncio's loop stays one setting away,
    and a worker told to have uvloop where it is missing says so."""
    import sys

    uvloop = pytest.importorskip("uvloop")  # not installed on Windows

    from compactd.storage.errors import ConfigError
    from compactd.worker.runtime import LoopThread, new_worker_loop
    from compactd.worker.settings import WorkerConfig

    config = load_config({"COMPACTD_HOME": str(tmp_path)})  # embedded: no server needed
    assert config.worker.event_loop == "auto"
    thread = LoopThread(config)
    try:
        assert isinstance(thread.loop, uvloop.Loop)
    finally:
        thread.close()
    plain = LoopThread(dataclasses.replace(config, worker=WorkerConfig(event_loop="asyncio")))
    try:
        assert not isinstance(plain.loop, uvloop.Loop)
        assert isinstance(plain.loop, asyncio.AbstractEventLoop)
    finally:
        plain.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    assert new_worker_loop("auto") is asyncio.new_event_loop
    with pytest.raises(ConfigError, match=r"worker\.event_loop"):
        new_worker_loop("uvloop")


def test_a_worker_told_to_have_uvloop_where_it_is_missing_does_not_start(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's signal logs a handler's exception and goes on, which would leave a worker that
    fails every task: the start-up handler stops the worker instead, naming the setting."""
    import sys

    from celery.signals import worker_init

    import compactd.worker.tasks  # noqa: F401  (connects the start-up handler)
    from compactd.worker.settings import WorkerConfig

    config = load_config({"COMPACTD_HOME": str(tmp_path)})
    config = dataclasses.replace(config, worker=WorkerConfig(event_loop="uvloop"))

    class WorkController:  # hashable, as Celery's own sender is
        app = SimpleNamespace(conf=SimpleNamespace(compactd_config=config))

    sender = WorkController()
    monkeypatch.setitem(sys.modules, "uvloop", None)
    before = gc.get_threshold()
    try:
        with pytest.raises(SystemExit, match=r"worker\.event_loop: uvloop is not installed"):
            worker_init.send(sender=sender)  # as Celery sends it, through every handler
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_starting_worker_loads_its_models_encodings_before_its_first_run(
        tmp_path: Any) -> None:
    """A first compaction that parsed the BPE file itself landed most of a second later than
    the next ones, and its session sent that many more steps over the trigger."""
    from compactd.storage import tokens
    from compactd.worker.tasks import _prepare_process

    config = load_config({"COMPACTD_HOME": str(tmp_path)})  # the local summarizer: no SDK
    config = dataclasses.replace(config, models=[
        ModelSpec(name="legacy", model="gpt-4-0613", provider="local")])
    sender = SimpleNamespace(app=SimpleNamespace(conf=SimpleNamespace(compactd_config=config)))
    before = gc.get_threshold()
    tokens.encoding.cache_clear()
    try:
        _prepare_process(sender=sender)  # what Celery's worker_init runs
        loaded = tokens.encoding.cache_info().currsize
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    # o200k for a model the config does not name, cl100k for the configured model's id.
    assert loaded == 2
