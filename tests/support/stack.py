"""Real processes for acceptance tests and benchmarks: Celery workers, beat and the CLI as
subprocesses, against real PostgreSQL and Redis, with the fake provider over HTTP.

    with Stack(pg_url, redis_url, tmp_path, fake_url=fake.url, summarization={...}) as stack:
        worker = stack.start_worker("w1")
        stack.cli("ingest", path, "--session", "s1", "--run-model", "fake-gpt")
        stack.cli("compact", "s1", "--wait", "--json")

The stack writes a config file whose models point at the fake provider (``fake-gpt`` and
``fake-mini`` through the openai SDK; ``fake-claude`` through the anthropic SDK only for a stack
made with ``claude=True``), gives every process the same environment, and kills whatever it
started when it closes. A worker of this interpreter's compactd is a fork of a launcher that
imported its third-party modules (tests/support/cli_launcher.py), as the CLI's commands are.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.support import cli_launcher
from tests.support.releases import CURRENT_PREFIX, MODULE_PREFIX_ENV

REPO = Path(__file__).resolve().parents[2]
FAKE_KEY_ENV = "COMPACTD_FAKE_API_KEY"
T = TypeVar("T")
# What a worker process imports before it is ready, the third-party part of which its launcher
# preloads: the app, its tasks and Flower's hooks, Celery's worker and its threads pool and
# Redis transport, and the SDK of the models every stack has but a claude one.
WORKER_IMPORTS = ("compactd.worker.app", "compactd.worker.tasks", "compactd.worker.flower",
                  "celery.bin.celery", "celery.apps.worker", "celery.worker.consumer",
                  "celery.concurrency.thread", "kombu.transport.redis", "openai")
# What `compactd serve` imports before it listens: the CLI and the HTTP server.
SERVE_IMPORTS = (cli_launcher.CLI_MODULE, "compactd.scheduler.http.server")
Process = subprocess.Popen[bytes] | cli_launcher.Launched


def _module(name: str, env: Mapping[str, str] | None) -> str:
    """``name`` as the code the environment runs imports it: under ``compactd.``, or bare for an
    earlier release's tree (``tests.support.releases.MODULE_PREFIX_ENV``)."""
    return (env or {}).get(MODULE_PREFIX_ENV, CURRENT_PREFIX) + name


def wait_until(predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.1,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def fake_models(fake_url: str, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    return [
        {"name": "fake-gpt", "provider": "openai", "model": "fake-gpt",
         "base_url": f"{fake_url}/v1", "api_key_env": FAKE_KEY_ENV,
         "context_window": 128_000, "timeout_s": timeout_s},
        {"name": "fake-mini", "provider": "openai-compatible", "model": "fake-mini",
         "base_url": f"{fake_url}/v1", "api_key_env": FAKE_KEY_ENV,
         "context_window": 128_000, "timeout_s": timeout_s},
        {"name": "fake-claude", "provider": "anthropic", "model": "fake-claude",
         "base_url": fake_url, "api_key_env": FAKE_KEY_ENV,
         "context_window": 200_000, "timeout_s": timeout_s},
    ]


def openai_models(fake_url: str) -> list[dict[str, Any]]:
    """:func:`fake_models` without the anthropic one: a stack's models unless it asks for
    ``fake-claude``. A worker imports the SDK of every configured model before it is ready, and
    anthropic's is the slowest (docs/benchmarks.md), paid by every worker start of a test that
    never calls it."""
    return [m for m in fake_models(fake_url) if m["provider"] != "anthropic"]


class Stack:
    def __init__(self, database_url: str, redis_url: str, home: Path, *,
                 fake_url: str | None = None, claude: bool = False,
                 summarization: Mapping[str, Any] | None = None,
                 worker: Mapping[str, Any] | None = None, default_model: str | None = None,
                 models: Sequence[Mapping[str, Any]] | None = None,
                 extra_env: Mapping[str, str] | None = None,
                 python: Path | None = None,
                 extra_config: Mapping[str, Any] | None = None) -> None:
        # Another interpreter (a venv with compactd installed) runs the processes from its own
        # installed copy: the repository stays off their import path.
        self.python = str(python) if python is not None else sys.executable
        self.home = home
        self.home.mkdir(parents=True, exist_ok=True)
        self.database_url = database_url
        self.redis_url = redis_url
        config: dict[str, Any] = {}
        if models is not None:
            config["models"] = list(models)
        elif fake_url:
            # fake-claude only where a test reaches it (a run model, a candidate, a policy's
            # model_name): the others' workers start without the anthropic SDK.
            config["models"] = fake_models(fake_url) if claude else openai_models(fake_url)
        if default_model:
            config["default_model"] = default_model
        if summarization:
            config["summarization"] = dict(summarization)
        # Tests run several workers on one host: metrics off unless a test asks for a port.
        config["worker"] = {"metrics_port": 0, **(worker or {})}
        config.update(extra_config or {})
        self.config_path = home / "compactd.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
        self.env.update({
            "PYTHONPATH": ("" if python is not None
                           else str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")),
            "COMPACTD_DATABASE_URL": database_url,
            "COMPACTD_BROKER_URL": redis_url,
            "COMPACTD_CONFIG": str(self.config_path),
            "COMPACTD_HOME": str(home),
            "COMPACTD_LOG_FORMAT": "json",
            FAKE_KEY_ENV: "sk-fake-test-key",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        })
        self.procs: dict[str, Process] = {}

    # -------------------------------------------------------------------------- processes

    def start_worker(self, name: str = "w1", *, concurrency: int = 16,
                     queues: Sequence[str] = ("compaction.urgent", "compaction.pressure",
                                              "compaction.bulk"),
                     env: Mapping[str, str] | None = None, ready_timeout: float = 30.0
                     ) -> Process:
        log = self.home / f"{name}.log"
        app = _module("worker.app", env)  # namespace: keep
        args = ["-A", app, "worker", "-n", f"{name}@%h", "-Q", ",".join(queues),
                "--concurrency", str(concurrency), "-l", "INFO", "--without-gossip",
                "--without-mingle"]
        worker_env = {**self.env, **(env or {})}
        proc: Process | None = None
        with log.open("ab") as output:
            # This interpreter's compactd: a fork of a launcher that imported the worker's
            # third-party modules (tests/support/cli_launcher.py), still a celery worker
            # process of its own, in its own session, that imports compactd itself.
            if self.python == sys.executable and app == CURRENT_PREFIX + "worker.app":
                proc = cli_launcher.start(worker_env, "celery", args, cwd=self.home,
                                          output=output.fileno(), imports=WORKER_IMPORTS)
            if proc is None:
                proc = subprocess.Popen([self.python, "-m", "celery", *args], env=worker_env,
                                        cwd=self.home, stdout=output,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        wait_until(lambda: proc.poll() is not None or "ready" in self.log(name),
                   timeout=ready_timeout, what=f"worker {name} to be ready")
        if proc.poll() is not None:
            raise AssertionError(f"worker {name} exited:\n{self.log(name)[-3000:]}")
        return proc

    def start_beat(self, name: str = "beat") -> subprocess.Popen[bytes]:
        log = self.home / f"{name}.log"
        proc = subprocess.Popen(
            [self.python, "-m", "celery", "-A", "compactd.worker.app", "beat", "-l", "INFO",
             "-s", str(self.home / "celerybeat-schedule")],
            env=self.env, cwd=self.home, stdout=log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
              ) -> Process:
        log = self.home / f"{name}.log"
        proc_env = {**self.env, **(env or {})}
        proc: Process | None = None
        with log.open("ab") as output:
            # This interpreter's compactd command (serve): forked as a worker is.
            if list(argv[:3]) == [sys.executable, "-m", cli_launcher.CLI_MODULE]:
                proc = cli_launcher.start(proc_env, cli_launcher.CLI_MODULE, argv[3:],
                                          cwd=self.home, output=output.fileno(),
                                          imports=SERVE_IMPORTS)
            if proc is None:
                proc = subprocess.Popen(list(argv), env=proc_env, cwd=self.home,
                                        stdout=output, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def task_ended(self, name: str, task_id: str | None) -> dict[str, Any] | None:
        """Celery's own JSON line saying how the ``compaction.run`` task ``task_id`` ended in
        worker ``name``'s log (succeeded or raised), None until it has."""
        for line in self.log(name).splitlines():
            if line.startswith("{") and f"compaction.run[{task_id}]" in line:
                entry: dict[str, Any] = json.loads(line)
                if entry["logger"] == "celery.app.trace":
                    return entry
        return None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self, name: str) -> None:
        """A warm shutdown (SIGTERM), killed if it takes too long."""
        self.kill(name, signal.SIGTERM)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------- CLI

    def cli(self, *args: str, check: bool = True, timeout: float = 180.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cli = _module("scheduler.cli", env)  # namespace: keep
        out = cli_launcher.run({**self.env, **(env or {})}, args, cwd=self.home,
                               timeout=timeout, python=self.python, module=cli)
        if check and out.returncode != 0:
            raise AssertionError(f"compactd {' '.join(args)} exited {out.returncode}:\n"
                                 f"{out.stdout}\n{out.stderr}")
        return out

    def cli_json(self, *args: str, check: bool = True, timeout: float = 180.0) -> Any:
        out = self.cli(*args, "--json", check=check, timeout=timeout)
        return json.loads(out.stdout)

    def ingest(self, session: str, messages: Sequence[Mapping[str, Any]], *,
               run_model: str | None = "fake-gpt") -> None:
        path = self.home / f"{session}.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in messages))
        args = ["ingest", str(path), "--session", session]
        if run_model:
            args += ["--run-model", run_model]
        self.cli(*args)

    @contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """SIGSTOP a process for the block (a stalled worker), then SIGCONT it."""
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
