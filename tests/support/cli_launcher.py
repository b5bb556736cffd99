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

Celery workers (and ``compactd serve``) are started the same way, from a launcher of their own
preloaded with what they import (``tests.support.stack.WORKER_IMPORTS``, ``SERVE_IMPORTS``):

    proc = start(env, "celery", ["-A", "compactd.worker.app", "worker", ...], cwd=home,
                 output=log_fd, imports=WORKER_IMPORTS)

``start`` returns a :class:`Launched` (pid, ``poll``, ``wait``, ``returncode`` as a ``Popen``
has them) for a process in a session of its own, or None where the caller is to start a fresh
interpreter (``COMPACTD_TEST_WORKER_LAUNCHER=0``, or no launcher).
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import select
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
WORKER_SWITCH_ENV = "COMPACTD_TEST_WORKER_LAUNCHER"
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
sock_path, modules_path, module = sys.argv[1], sys.argv[2], sys.argv[3]
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
                request = pickle.loads(body)
                # A command in a session of its own (start_new_session) is its group's leader
                # before its pid is sent: a signal to its group cannot precede the group.
                led_r, led_w = os.pipe() if request[3] else (None, None)
                pid = os.fork()
                if pid == 0:
                    if led_w is not None:
                        os.setsid()
                        os.close(led_w)
                        os.close(led_r)
                    sel.close()
                    listener.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in waiting.values():
                        other.close()
                    conn.close()
                    return request, fds
                if led_w is not None:
                    os.close(led_w)
                    os.read(led_r, 1)
                    os.close(led_r)
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
(argv, environ, cwd, _), fds = request
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
runpy._run_module_as_main(module, alter_argv=True)
'''


class LauncherGone(Exception):
    """The launcher did not take the command (it has ended): the command did not start."""


class Launched:
    """A command :meth:`Launcher.start` started, read as a ``subprocess.Popen``: its pid, and
    its exit code (negative for a signal) once the launcher, its parent, reaped it."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._status = b""

    def _receive(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return False
            got = self._conn.recv(_HEADER.size - len(self._status))
            if not got:
                raise RuntimeError("the compactd launcher ended before the command")
            self._status += got
            if len(self._status) == _HEADER.size:
                self._conn.close()
                self.returncode = _exit_code(self._status)
        return True

    def poll(self) -> int | None:
        self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._receive(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """One launcher process serving the commands ``python -m module`` whose interpreter starts
    with ``env``'s startup variables, preloaded with the third-party modules that importing
    ``imports`` loads."""

    def __init__(self, python: str, env: Mapping[str, str], *, module: str = CLI_MODULE,
                 imports: Sequence[str] = (CLI_MODULE,)) -> None:
        self.module = module
        self.imports = tuple(imports)
        self.dir = tempfile.mkdtemp(prefix="compactd-launcher-")
        self.sock_path = os.path.join(self.dir, "sock")
        modules = os.path.join(self.dir, "modules")
        # The third-party modules importing them loads, as a fresh interpreter lists them.
        listed = subprocess.run(
            [python, "-c", f"import {', '.join(imports)}, sys\n"
             "print('\\n'.join(m for m in sys.modules if m.split('.')[0] != 'compactd'))"],
            env=dict(env), capture_output=True, text=True, timeout=READY_TIMEOUT_S, check=True)
        Path(modules).write_text(listed.stdout)
        self.proc = subprocess.Popen(
            [python, "-c", LAUNCHER, self.sock_path, modules, module], env=dict(env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != b"ready\n":
            raise RuntimeError("the compactd launcher did not start")

    def _fork(self, args: Sequence[str], env: Mapping[str, str], cwd: str, fds: list[int],
              new_session: bool) -> tuple[socket.socket, int]:
        """The command forked with ``fds`` as its stdin, stdout and stderr: the connection that
        will bring its wait status, and its pid."""
        body = pickle.dumps(([os.fsencode(a) for a in (self.module, *args)],
                             {os.fsencode(k): os.fsencode(v) for k, v in env.items()},
                             os.fsencode(cwd), new_session))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.sock_path)
            socket.send_fds(conn, [_HEADER.pack(len(body))], fds)
            conn.sendall(body)
        except OSError as exc:
            conn.close()
            raise LauncherGone from exc  # the command has not started
        except BaseException:
            conn.close()
            raise
        return conn, _HEADER.unpack(_recv_exactly(conn, _HEADER.size))[0]

    def run(self, args: Sequence[str], env: Mapping[str, str], cwd: str,
            timeout: float | None) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", self.module, *args]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            conn, pid = self._fork(args, env, cwd, [0, out_w, err_w], new_session=False)
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return _collect(conn, pid, argv, out_r, err_r, timeout)

    def start(self, args: Sequence[str], env: Mapping[str, str], cwd: str,
              output: int) -> Launched:
        """The command started in a session of its own, its stdout and stderr on ``output``,
        as ``subprocess.Popen(..., stdout=output, stderr=output, start_new_session=True)``."""
        conn, pid = self._fork(args, env, cwd, [0, output, output], new_session=True)
        return Launched([sys.executable, "-m", self.module, *args], pid, conn)

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
    return subprocess.CompletedProcess(argv, _exit_code(status), _text(b"".join(chunks[out_r])),
                                       _text(b"".join(chunks[err_r])))


def _exit_code(status: bytes) -> int:
    code: int = _HEADER.unpack(status)[0]
    return code - (1 << 32) if code >= 1 << 31 else code


def _text(data: bytes) -> str:
    # As subprocess decodes with text=True: the locale's encoding, universal newlines.
    return io.TextIOWrapper(io.BytesIO(data)).read()


_launchers: dict[tuple[object, ...], Launcher | None] = {}
_lock = threading.Lock()


def _launcher(python: str, env: Mapping[str, str], *, module: str = CLI_MODULE,
              imports: Sequence[str] = (CLI_MODULE,)) -> Launcher | None:
    with _lock:
        key = _key(python, env, module, imports)
        if key not in _launchers:
            try:
                _launchers[key] = Launcher(python, env, module=module, imports=imports)
            except (OSError, RuntimeError, subprocess.SubprocessError):
                _launchers[key] = None  # its commands run as plain subprocesses
        return _launchers[key]


def _key(python: str, env: Mapping[str, str], module: str,
         imports: Sequence[str]) -> tuple[object, ...]:
    if module == CLI_MODULE and tuple(imports) == (CLI_MODULE,):
        return (python, _startup_env(env))
    # A long-running process (a worker) is forked only from a launcher started with the same
    # environment but compactd's own variables, which only compactd's modules read, and the
    # name of the test pytest is running: a third-party module imported in the launcher may
    # have read any other at its import.
    return (python, module, tuple(imports), tuple(sorted(
        (k, v) for k, v in env.items()
        if not k.startswith("COMPACTD_") and k != "PYTEST_CURRENT_TEST")))


def _forget(launcher: Launcher, python: str, env: Mapping[str, str]) -> None:
    """A launcher that ended: its commands run as plain subprocesses from now on."""
    with _lock:
        _launchers[_key(python, env, launcher.module, launcher.imports)] = None
    launcher.close()


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
            _forget(launcher, sys.executable, env)
    return subprocess.run([python, "-m", module, *args], env=dict(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def start(env: Mapping[str, str], module: str, args: Sequence[str], *, cwd: str | Path,
          output: int, imports: Sequence[str]) -> Launched | None:
    """``python -m module ARGS`` started in a session of its own from a launcher preloaded
    with the third-party modules importing ``imports`` loads, stdout and stderr on the file
    descriptor ``output``; None where it is not served (``WORKER_SWITCH_ENV=0``, or no launcher
    could start): the caller starts a fresh interpreter."""
    if os.environ.get(WORKER_SWITCH_ENV, "1") == "0":
        return None
    launcher = _launcher(sys.executable, env, module=module, imports=imports)
    if launcher is None:
        return None
    try:
        return launcher.start(args, env, os.fspath(cwd), output)
    except LauncherGone:
        _forget(launcher, sys.executable, env)
        return None
