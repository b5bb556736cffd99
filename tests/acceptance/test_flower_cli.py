"""``celery -A compactd.worker.app flower`` as an operator types it: credentials from any of the
places Flower reads options (environment, command line, ``flowerconfig.py``), and no start
without."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.probes import free_port, http_status
from tests.support.stack import wait_until

# A flowerconfig.py (Flower runs it as Python) that delivers an early signal (SIGNAL: a
# supervisor's SIGTERM, an operator's Ctrl-C) at the worst moment chance can pick: once Flower has
# its SIGTERM handler, right after its executor starts its first thread and before the executor
# has registered that thread for the exit.
SIGNAL_AS_THE_EXECUTOR_STARTS = """
import os
import signal
import threading

basic_auth = ["ops:pw"]
_start = threading.Thread.start


def _start_then_sigterm(thread):
    _start(thread)
    if thread.name.startswith("ThreadPoolExecutor") and (
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        threading.Thread.start = _start
        os.kill(os.getpid(), signal.SIGNAL)


threading.Thread.start = _start_then_sigterm
"""


def _env(tmp_path: Path, broker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "FLOWER_"))}
    env.update(PYTHONPATH=str(REPO), COMPACTD_HOME=str(tmp_path), COMPACTD_BROKER_URL=broker,
               COMPACTD_LOG_FORMAT="json")
    return env


def test_flower_refuses_to_start_without_authentication(tmp_path: Path) -> None:
    # Nothing listens on the broker's port: the refusal comes before any connection.
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "compactd.worker.app", "flower",
                          "--port=0", "--address=127.0.0.1"],
                         env=_env(tmp_path, "redis://127.0.0.1:9/0"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Flower refuses to start without authentication" in out.stderr
    assert "FLOWER_BASIC_AUTH" in out.stderr


@pytest.mark.parametrize("argv, env", [
    ((), {"FLOWER_BASIC_AUTH": ":"}),  # what "$USER:$PASS" gives with both unset
    ((), {"FLOWER_BASIC_AUTH": "ops:"}),
    (("--basic-auth=ops:pw,:admin",), {}),
    ((), {"FLOWER_BASIC_AUTH": ":", "COMPACTD_FLOWER_UNAUTHENTICATED": "1"}),
])
def test_flower_refuses_an_empty_user_or_password(
        argv: tuple[str, ...], env: dict[str, str], tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "compactd.worker.app", "flower",
                          "--port=0", "--address=127.0.0.1", *argv],
                         env={**_env(tmp_path, "redis://127.0.0.1:9/0"), **env}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "has an empty user or password" in out.stderr, out.stderr[-2000:]
    assert "admin" not in out.stderr


@pytest.mark.redis
@pytest.mark.parametrize("source", ["environment", "command line", "flowerconfig.py"])
def test_flower_takes_credentials_from_where_flower_reads_options(
        source: str, tmp_path: Path, clean_redis: str) -> None:
    port = free_port()
    env = _env(tmp_path, clean_redis)
    argv = [sys.executable, "-m", "celery", "-A", "compactd.worker.app", "flower", f"--port={port}",
            "--address=127.0.0.1"]
    if source == "environment":
        env["FLOWER_BASIC_AUTH"] = "ops:pw"
    elif source == "command line":
        argv.append("--basic-auth=ops:pw")
    else:
        (tmp_path / "flowerconfig.py").write_text('basic_auth = ["ops:pw"]\n')
    log = tmp_path / "flower.log"
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/tasks"
        wait_until(lambda: http_status(url) or proc.poll() is not None, timeout=60,
                   what="Flower to answer")
        assert proc.poll() is None, log.read_text()[-3000:]
        assert http_status(url) == 401
        assert http_status(url, ("ops", "nope")) == 401
        assert http_status(url, ("ops", "pw")) == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # Flower's own lines are compactd's JSON lines too.
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), lines[:5]


@pytest.mark.redis
@pytest.mark.timed
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_flower_exits_on_a_signal_that_lands_while_it_starts(
        signame: str, tmp_path: Path, clean_redis: str) -> None:
    # systemd or Kubernetes stopping a Flower that is still starting, or Ctrl-C.
    (tmp_path / "flowerconfig.py").write_text(
        SIGNAL_AS_THE_EXECUTOR_STARTS.replace("SIGNAL", signame))
    log = tmp_path / "flower.log"
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "compactd.worker.app", "flower",
                             f"--port={free_port()}", "--address=127.0.0.1"],
                            env=_env(tmp_path, clean_redis), cwd=tmp_path, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            # A shell's background job inherits SIGINT ignored; a terminal's
                            # Flower does not.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # The banner comes after the handler is installed and before the executor's first
        # thread: the signal follows it at once.
        wait_until(lambda: "Visit me at" in log.read_text() or proc.poll() is not None,
                   timeout=60, what="Flower's banner")
        try:
            returncode = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"Flower did not exit within 30 s of the {signame} it got while "
                        "starting:\n" + log.read_text()[-3000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == 0, log.read_text()[-3000:]
    assert f"{signame}: Flower stops" in log.read_text()
