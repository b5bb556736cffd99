"""A PgBouncer of the test's own (Debian's package; ops/test installs it), in front of the test
PostgreSQL: a temporary directory holds its config, its log and its pid file, it listens on a
free loopback port, and it is stopped when the block ends. Never the system's pgbouncer service.

    with PgBouncer(pg_url, pool_mode="transaction") as bouncer:
        bouncer.url          # the same database, through the pooler
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import urlparse

from tests.support.services import debian_packages_settled

BINARY = "/usr/sbin/pgbouncer"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    def __init__(self, database_url: str, *, pool_mode: str = "transaction",
                 pool_size: int = 10, server_lifetime: float = 3600) -> None:
        self.target = urlparse(database_url)
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        # PgBouncer's setting: 0 closes a server connection after its one use, so every
        # transaction of a client runs on a server connection of its own.
        self.server_lifetime = server_lifetime
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="compactd-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The test database's URL with the pooler's address in place of the server's."""
        user = self.target.username or "postgres"
        return f"postgresql://{user}@127.0.0.1:{self.port}{self.target.path}"

    async def admin(self, command: str) -> None:
        """A command of PgBouncer's admin console (the virtual database ``pgbouncer``)."""
        import asyncpg

        user = self.target.username or "postgres"
        conn = await asyncpg.connect(f"postgresql://{user}@127.0.0.1:{self.port}/pgbouncer",
                                     statement_cache_size=0)
        try:
            await conn.execute(command)
        finally:
            await conn.close()

    @property
    def database(self) -> str:
        return self.target.path.lstrip("/")

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> PgBouncer:
        debian_packages_settled()
        binary = shutil.which("pgbouncer") or BINARY
        if not Path(binary).exists():
            from tests.conftest import missing

            missing("pgbouncer is not installed (ops/test installs it: apt-get install pgbouncer)")
        user = self.target.username or "postgres"
        # The local server trusts loopback connections; the pooler passes the user through.
        (self.dir / "userlist.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(f"""\
[databases]
* = host={self.target.hostname or "127.0.0.1"} port={self.target.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir / "userlist.txt"}
admin_users = {user}
pool_mode = {self.pool_mode}
default_pool_size = {self.pool_size}
server_lifetime = {self.server_lifetime:g}
max_client_conn = 500
logfile = {self.dir / "pgbouncer.log"}
pidfile = {self.dir / "pgbouncer.pid"}
""")
        args = [binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            # PgBouncer refuses to run as root: as the server's own user, which owns its files.
            owner = pwd.getpwnam("postgres")
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            for path in self.dir.iterdir():
                os.chown(path, owner.pw_uid, owner.pw_gid)
            args[1:1] = ["-u", "postgres"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"pgbouncer did not start:\n{self.log()}") from None
                time.sleep(0.05)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # immediate shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
