"""A redis-server of a test's own, for tests that stop and restart the broker.

The shared Redis (``COMPACTD_TEST_REDIS_URL``) is never restarted: other tests and helpers use
it. This one listens on a free port, keeps nothing on disk (a restart empties it, as a Redis
without persistence does) and is killed, never shut down cleanly.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from tests.support.probes import free_port
from tests.support.stack import wait_until


class PrivateRedis:
    """A redis-server of this test's own (the shared one must never be restarted)."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.home = home
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            from tests.conftest import missing

            missing("redis-server is not installed")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.home)],
            stdout=(self.home / "redis.log").open("ab"), stderr=subprocess.STDOUT)
        wait_until(self.answers, timeout=10, what="the private redis-server")

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def queued_runs(self, session_id: str, queue: str = "compaction.pressure") -> list[Any]:
        """The compaction.run messages for ``session_id`` waiting in ``queue``."""
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            messages = client.lrange(queue, 0, -1)
        finally:
            client.close()
        out = []
        for raw in messages:
            headers = json.loads(raw).get("headers") or {}
            if headers.get("task") == "compaction.run" and repr(session_id) in str(
                    headers.get("kwargsrepr")):
                out.append(raw)
        return out
