"""compactd built and installed the way a user gets it, once per test run.

The plain install's test and the wheel's test each need a fresh venv holding compactd with no
extra: a venv and its dependencies take most of a minute, so the run builds one and both use it.
``pip install .`` builds a wheel from the source tree and installs it; here the two steps are
made apart, once (the wheel from a copy of the repository, without its .git, venv or caches;
then the wheel into a fresh venv), so the wheel's own contents can be checked too.

Under pytest-xdist the two tests may run on different workers at once: the build is made under
a file lock in the run's own temporary directory (the parent of the workers' own ones), and the
worker that comes second waits for it and uses it. A failed build leaves nothing behind: the
next test to ask builds again and reports its own failure.

Most of the build's minute is pip waiting on the package index, not the CPU: when a run collects
a test that needs it, the build starts at once in a process of its own (`start_in_background`,
from tests/conftest.py), under the same lock, so it overlaps the tests scheduled before these
and the first of them to ask finds it made, or waits for the rest of it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.stack import REPO

COPY_IGNORES = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                      "dist", ".*_cache", ".hypothesis", "test-artifacts")


@dataclass(frozen=True)
class Installed:
    wheel: Path  # the wheel built from the copy of the repository
    python: Path  # a fresh venv's interpreter, the wheel installed with no extra


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary directory, the one every xdist worker's own is made in."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(root: Path) -> Installed:
    source = root / "src"
    shutil.copytree(REPO, source, ignore=COPY_IGNORES)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                           "--disable-pip-version-check", "--wheel-dir", str(root / "dist"),
                           str(source)], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (root / "dist").glob("compactd-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=480, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return Installed(wheel, python)


def installed_compactd(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The run's one wheel and venv, built by the first test to ask (or in the background)."""
    return _installed(_run_dir(tmp_path_factory))


# The test files whose tests need the build.
NEEDED_BY = ("test_plain_install.py", "test_wheel_install.py")


def start_in_background(tmp_path_factory: pytest.TempPathFactory
                        ) -> subprocess.Popen[bytes] | None:
    """Start the run's build in a process of its own, unless another xdist worker did."""
    run = _run_dir(tmp_path_factory)
    try:
        (run / "compactd-installed.started").touch(exist_ok=False)
    except FileExistsError:
        return None
    with (run / "compactd-installed.log").open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.support.install", str(run)],
                                cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _installed(run: Path) -> Installed:
    root = run / "compactd-installed"
    ready = root / "ready"
    with _locked(run / "compactd-installed.lock"):
        if not ready.exists():
            shutil.rmtree(root, ignore_errors=True)  # a build that failed half-way
            root.mkdir()
            _build(root)
            ready.touch()
    (wheel,) = (root / "dist").glob("compactd-*.whl")
    return Installed(wheel, root / "venv" / "bin" / "python")


if __name__ == "__main__":
    _installed(Path(sys.argv[1]))  # the background build: `python -m tests.support.install RUN`
