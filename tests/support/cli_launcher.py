"""``compactd`` commands as subprocesses forked from an interpreter that has already imported
the third-party libraries the CLI loads (SQLAlchemy, pydantic, aiosql, yaml, the drivers).

The suite runs the CLI as a subprocess thousands of times, and nearly all of such a process's
CPU is its imports, most of them the same third-party modules every time. A launcher imports
those once per test process; each command is a fork of it that runs
``python -m compactd.scheduler.cli ARGS`` as the interpreter would, in its own process, with
the test's environment, working directory and pipes. compactd's own modules are never
imported by the launcher: each command imports them anew, so what they do at import (read the
environment, fail to import) happens in the command as it would in a fresh interpreter.

    out = run(env, ["ingest", path, "--session", "s1"], cwd=home, timeout=120)

``run`` returns what ``subprocess.run(..., capture_output=True, text=True)`` returns, and
raises its ``TimeoutExpired``. A command whose interpreter would start differently (another
Python, another ``PYTHON*`` or locale variable) gets a launcher of its own; one the launcher
cannot serve runs as a plain subprocess, and so does every command when the test process has
``COMPACTD_TEST_CLI_LAUNCHER=0`` (to tell a difference the launcher makes from a bug).
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

CLI_MODULE = "compactd.scheduler.cli"
# Variables that decide how an interpreter starts (its import path, hash seed, encodings,
# bytecode, warnings): a launcher serves only commands whose values it was started with.
# PYTHONUNBUFFERED is applied in the command itself.
STARTUP_VARS_PREFIXES = ("PYTHON", "LC_", "LANG")
APPLIED_IN_COMMAND = ("PYTHONUNBUFFERED",)
READY_TIMEOUT_S = 60.0
SWITCH_ENV = "COMPACTD_TEST_CLI_LAUNCHER"
_HEADER = struct.Struct("!I")


def _startup_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(STARTUP_VARS_PREFIXES) and k not in APPLIED_IN_COMMAND))


# The launcher's own program, run with ``python -c``. It imports the CLI's third-party modules,
# then serves requests on a Unix socket: each brings argv, environment and working directory
# and the command's stdin, stdout and stderr; the launcher forks, sends back the child's pid,
# and later its wait status. The child leaves the loop and runs the CLI module as ``-m`` would,
# ending as an interpreter ends (exit code, traceback, atexit).
LAUNCHER = r'''
import os, pickle, selectors, signal, socket, struct, sys
HEADER = struct.Struct("!I")
sock_path, modules_path = sys.argv[1], sys.argv[2]
for name in open(modules_path).read().split():
    try:
        __import__(name)
    except Exception:
        pass
del name

def serve():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    waiting = {}
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                return None  # the test process is gone: its pipe closed
            if key.data == "child":
                os.read(wake_r, 4096)
            else:
                conn, _ = listener.accept()
                size, fds = recv_request(conn)
                body = b""
                while len(body) < size:
                    chunk = conn.recv(size - len(body))
                    if not chunk:
                        break
                    body += chunk
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in waiting.values():
                        other.close()
                    conn.close()
                    return pickle.loads(body), fds
                for fd in fds:
                    os.close(fd)
                conn.sendall(HEADER.pack(pid))
                waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(HEADER.pack(os.waitstatus_to_exitcode(status) & 0xFFFFFFFF))
                except OSError:
                    pass
                conn.close()

def recv_request(conn):
    data, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    return HEADER.unpack(data)[0], fds

request = serve()
if request is None:
    sys.exit(0)
(argv, environ, cwd), fds = request
for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
os.chdir(cwd)
os.environb.clear()
os.environb.update(environ)
if os.environ.get("PYTHONUNBUFFERED"):
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
sys.argv = [os.fsdecode(a) for a in argv]
sys.orig_argv = [sys.executable, "-m", *sys.argv]
sys.path[0] = os.getcwd()
del request, argv, environ, cwd, fds, serve, recv_request
import runpy
runpy._run_module_as_main("compactd.scheduler.cli", alter_argv=True)
'''


class LauncherGone(Exception):
    """The launcher did not take the command (it has ended): the command did not start."""


class Launcher:
    """One launcher process serving the commands whose interpreter starts with ``env``'s
    startup variables."""

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="compactd-launcher-")
        self.sock_path = os.path.join(self.dir, "sock")
        modules = os.path.join(self.dir, "modules")
        # The third-party modules importing the CLI loads, as a fresh interpreter lists them.
        listed = subprocess.run(
            [python, "-c", f"import {CLI_MODULE}, sys\n"
             "print('\\n'.join(m for m in sys.modules if m.split('.')[0] != 'compactd'))"],
            env=dict(env), capture_output=True, text=True, timeout=READY_TIMEOUT_S, check=True)
        Path(modules).write_text(listed.stdout)
        self.proc = subprocess.Popen(
            [python, "-c", LAUNCHER, self.sock_path, modules], env=dict(env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != b"ready\n":
            raise RuntimeError("the compactd launcher did not start")

    def run(self, args: Sequence[str], env: Mapping[str, str], cwd: str,
            timeout: float | None) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", CLI_MODULE, *args]
        body = pickle.dumps(([os.fsencode(a) for a in argv[2:]],
                             {os.fsencode(k): os.fsencode(v) for k, v in env.items()},
                             os.fsencode(cwd)))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.sock_path)
            socket.send_fds(conn, [_HEADER.pack(len(body))], [0, out_w, err_w])
            conn.sendall(body)
        except BaseException as exc:
            conn.close()
            for fd in (out_r, err_r):
                os.close(fd)
            if isinstance(exc, OSError):
                raise LauncherGone from exc  # the command has not started
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        pid = _HEADER.unpack(_recv_exactly(conn, _HEADER.size))[0]
        return _collect(conn, pid, argv, out_r, err_r, timeout)

    def close(self) -> None:
        # Its stdin closing ends the launcher; commands still running go on to their end.
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise RuntimeError("the compactd launcher closed the connection")
        data += chunk
    return data


def _collect(conn: socket.socket, pid: int, argv: list[str], out_r: int, err_r: int,
             timeout: float | None) -> subprocess.CompletedProcess[str]:
    """The command's output and exit code, read as ``subprocess.run`` reads them; past
    ``timeout`` the command is killed and ``TimeoutExpired`` raised."""
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    status = b""
    sel = selectors.DefaultSelector()
    sel.register(out_r, selectors.EVENT_READ)
    sel.register(err_r, selectors.EVENT_READ)
    sel.register(conn, selectors.EVENT_READ)
    try:
        while len(sel.get_map()) > 0:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                os.kill(pid, signal.SIGKILL)
                _recv_exactly(conn, _HEADER.size - len(status))
                raise subprocess.TimeoutExpired(argv, timeout or 0.0, b"".join(chunks[out_r]),
                                                b"".join(chunks[err_r]))
            for key, _ in sel.select(left):
                if key.fileobj is conn:
                    got = conn.recv(_HEADER.size - len(status))
                    status += got
                    if not got or len(status) == _HEADER.size:
                        sel.unregister(conn)
                    continue
                fd = key.fd
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    sel.unregister(fd)
    finally:
        sel.close()
        os.close(out_r)
        os.close(err_r)
        conn.close()
    if len(status) != _HEADER.size:
        raise RuntimeError("the compactd launcher ended before the command")
    code = _HEADER.unpack(status)[0]
    returncode = code - (1 << 32) if code >= 1 << 31 else code
    return subprocess.CompletedProcess(argv, returncode, _text(b"".join(chunks[out_r])),
                                       _text(b"".join(chunks[err_r])))


def _text(data: bytes) -> str:
    # As subprocess decodes with text=True: the locale's encoding, universal newlines.
    return io.TextIOWrapper(io.BytesIO(data)).read()


_launchers: dict[tuple[object, ...], Launcher | None] = {}
_lock = threading.Lock()


def _launcher(python: str, env: Mapping[str, str]) -> Launcher | None:
    key = (python, _startup_env(env))
    with _lock:
        if key not in _launchers:
            try:
                _launchers[key] = Launcher(python, env)
            except (OSError, RuntimeError, subprocess.SubprocessError):
                _launchers[key] = None  # its commands run as plain subprocesses
        return _launchers[key]


@atexit.register
def _close_all() -> None:
    for launcher in _launchers.values():
        if launcher is not None:
            launcher.close()


def run(env: Mapping[str, str], args: Sequence[str], *, cwd: str | Path | None = None,
        timeout: float | None = None, python: str = sys.executable,
        module: str = CLI_MODULE) -> subprocess.CompletedProcess[str]:
    """``python -m module ARGS`` with ``env`` in ``cwd``, its output captured as text. Only
    this interpreter's compactd CLI is launched; another interpreter or module (a release's
    venv, its module prefix) starts fresh."""
    served = python == sys.executable and module == CLI_MODULE
    launcher = (None if not served or os.environ.get(SWITCH_ENV, "1") == "0"
                else _launcher(sys.executable, env))
    if launcher is not None:
        try:
            return launcher.run(args, env, os.fspath(cwd) if cwd is not None else os.getcwd(),
                                timeout)
        except LauncherGone:
            with _lock:
                _launchers[(sys.executable, _startup_env(env))] = None
            launcher.close()
    return subprocess.run([python, "-m", module, *args], env=dict(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
