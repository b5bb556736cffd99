"""A PostgreSQL primary and its streaming standby of the test's own, from the installed server
binaries (Debian's /usr/lib/postgresql/N/bin): each in a data directory under one temporary
directory, on a free loopback port, with its socket in that directory. Never the system's
cluster. Both are stopped and the directory removed when the block ends, however it ends.

    with PostgresPair(synchronous=True) as pair:
        pair.url("compactd")    # libpq's multi-host URL: whichever of the two is writable
        pair.stop_primary()     # a crash (immediate shutdown)
        pair.promote_standby()

Run as root (CI), the servers run as the ``postgres`` user, who owns the directory: initdb and
postgres refuse to run as root.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.pgbouncer import free_port
from tests.support.services import debian_packages_settled

SERVER_USER = "postgres"
TOOLS = ("initdb", "pg_ctl", "pg_basebackup", "psql")


def server_bin_dir() -> Path | None:
    """The newest installed server's binaries (all that the pair runs), None when there is
    none."""
    debian_packages_settled()
    found = sorted((Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
                   key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    complete = [d for d in found if all((d / tool).exists() for tool in TOOLS)]
    return complete[-1] if complete else None


class PostgresPair:
    """``synchronous``: the primary waits for the standby to flush each commit before it
    acknowledges it (synchronous_commit=on with the standby named in
    synchronous_standby_names); without it replication is asynchronous."""

    def __init__(self, *, synchronous: bool = True) -> None:
        self.synchronous = synchronous
        self.primary_port = free_port()
        self.standby_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="compactd-pgpair-"))
        self.primary_dir = self.dir / "primary"
        self.standby_dir = self.dir / "standby"
        self.bin: Path | None = None
        self._user: dict[str, Any] = {}

    def url(self, database: str, *, target: str = "read-write") -> str:
        """libpq's multi-host URL of both servers, asking for a session of ``target``."""
        return (f"postgresql://{SERVER_USER}@127.0.0.1:{self.primary_port},"
                f"127.0.0.1:{self.standby_port}/{database}?target_session_attrs={target}")

    def single_url(self, port: int, database: str = "postgres") -> str:
        return f"postgresql://{SERVER_USER}@127.0.0.1:{port}/{database}"

    def log(self, which: str) -> str:
        path = self.dir / f"{which}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ------------------------------------------------------------------------------ steps

    def _run(self, *args: str, timeout: float = 60) -> None:
        assert self.bin is not None
        out = subprocess.run([str(self.bin / args[0]), *args[1:]], capture_output=True,
                             text=True, timeout=timeout, **self._user)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {out.returncode}:\n"
                               f"{out.stdout}\n{out.stderr}")

    def _start(self, which: str, port: int, *options: str) -> None:
        settings = [f"-p {port}", "-c listen_addresses=127.0.0.1",
                    f"-c unix_socket_directories={self.dir}", "-c max_connections=200",
                    "-c shared_buffers=32MB", "-c max_wal_senders=4", "-c wal_level=replica",
                    "-c wal_keep_size=64MB", *options]
        self._run("pg_ctl", "-D", str(self.dir / which), "-l", str(self.dir / f"{which}.log"),
                  "-w", "-t", "30", "-o", " ".join(settings), "start")

    def __enter__(self) -> PostgresPair:
        self.bin = server_bin_dir()
        if self.bin is None:
            from tests.conftest import missing

            missing("no PostgreSQL server binaries under /usr/lib/postgresql (ops/test installs "
                    "them: apt-get install postgresql)")
        if os.geteuid() == 0:
            owner = pwd.getpwnam(SERVER_USER)
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            self._user = {"user": owner.pw_uid, "group": owner.pw_gid,
                          "env": {**os.environ, "HOME": owner.pw_dir}}
        try:
            self._run("initdb", "-D", str(self.primary_dir), "-U", SERVER_USER,
                      "--auth=trust", "--no-sync", "--no-instructions")
            sync = ["-c synchronous_commit=on", "-c synchronous_standby_names='*'"] \
                if self.synchronous else []
            self._start("primary", self.primary_port, *sync)
            self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary_port),
                      "-U", SERVER_USER, "-D", str(self.standby_dir), "-R",
                      "-X", "stream", "-c", "fast", "--no-sync")
            # The standby, once promoted, has no standby of its own: it must not wait for one.
            self._start("standby", self.standby_port, "-c synchronous_standby_names=''",
                        "-c cluster_name=standby")
            self._wait_streaming()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_streaming(self, timeout_s: float = 30) -> None:
        """Until the primary reports the standby streaming (and, when synchronous, as its
        synchronous standby)."""
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.psql(self.primary_port,
                              "SELECT sync_state FROM pg_stat_replication "
                              "WHERE state = 'streaming'")
            if state == want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby is not streaming ({state!r}):\n"
                                   f"{self.log('standby')[-2000:]}")
            time.sleep(0.1)

    def psql(self, port: int, query: str, database: str = "postgres") -> str:
        assert self.bin is not None
        out = subprocess.run([str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(port),
                              "-U", SERVER_USER, "-d", database, "-XAtqc", query],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"psql: {out.stderr}")
        return out.stdout.strip()

    def stop_primary(self) -> None:
        """The primary crashes: an immediate shutdown, no checkpoint, its connections cut."""
        self._run("pg_ctl", "-D", str(self.primary_dir), "-m", "immediate", "-w", "stop")

    def promote_standby(self) -> None:
        self._run("pg_ctl", "-D", str(self.standby_dir), "-w", "-t", "30", "promote")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for data in (self.standby_dir, self.primary_dir):
            pid_file = data / "postmaster.pid"
            if not pid_file.exists() or self.bin is None:
                continue
            subprocess.run([str(self.bin / "pg_ctl"), "-D", str(data), "-m", "immediate",
                            "-w", "stop"], capture_output=True, timeout=60, **self._user)
            if pid_file.exists():
                # pg_ctl could not stop it: end the postmaster by its own pid.
                with contextlib.suppress(ValueError, OSError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
