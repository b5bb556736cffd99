"""Earlier releases' code, from the repository's own history, run by this venv's interpreter.

``release_tree`` extracts the code of a commit (``git archive``: nothing is added to the
repository, no worktree to clean up) and ``release_env`` puts it first on ``PYTHONPATH``, ahead
of the editable install of the tree under test (whose finder comes after the path entries). The
dependencies are this venv's; the releases named here declare the same ones.

A missing history fails the test, never skips it: a mixed-release test that did not run old
code has proved nothing.
"""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import tarfile
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The release before versioned functions: the last commit at revision 0018, which calls the
# unversioned compactd_claim and its kin.
PREVIOUS_RELEASE = "bd287a3"
# The last release before this one's schema (revision 0022, counters by name), which calls the
# third generation of the append and the commit.
LATEST_RELEASE = "c1a9f07"
# Releases whose head revision the chain still has as they had it (a downgrade's landing
# places): 0015 before the checkpoint lead changed the append and the commit, 0017 before
# the beat_runs table.
RELEASE_AT = {"0015": "e746056", "0017": "e34ca83"}

_PACKAGES = ("storage", "worker", "scheduler")
# A release with the compactd namespace keeps the namespace's own modules (compactd.client)
# here (its pyproject's package-dir).
_PUBLIC = Path("scheduler") / "public"
# Releases before the compactd namespace import as ``storage.x``, not ``compactd.storage.x``. An
# environment naming this variable tells the stack which (the empty string: the bare names of a
# release before the namespace).
MODULE_PREFIX_ENV = "RELEASE_MODULE_PREFIX"
CURRENT_PREFIX = "compactd."


def module_prefix(tree: Path) -> str:
    """What ``tree``'s packages import under: ``compactd.`` for the tree under test and for a
    release extracted with the namespace (``tree/compactd``), bare for one before it."""
    return CURRENT_PREFIX if tree.resolve() == REPO or (tree / "compactd").is_dir() else ""


def release_tree(commit: str, dest: Path) -> Path:
    """The code of ``commit`` (its Python packages) under ``dest``, extracted once: a release
    with the compactd namespace laid out as it installs (``dest/compactd/storage``, its public
    modules in ``dest/compactd``), so that it imports ahead of the tree under test."""
    if (dest / "storage").is_dir() or (dest / "compactd").is_dir():
        return dest
    git = shutil.which("git")
    if git is None:
        pytest.fail(f"git is not installed: the test runs release {commit}'s code from the "
                    f"repository's history (install git)")
    known = subprocess.run([git, "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                            f"{commit}^{{commit}}"], capture_output=True, text=True)
    if known.returncode != 0:
        pytest.fail(f"commit {commit} is not in the history of {REPO} ({known.stderr.strip()}"
                    f"): the test runs that release's code; clone the repository with its "
                    f"history (not a shallow or exported copy)")
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "release.tar"
    subprocess.run([git, "-C", str(REPO), "archive", "--format=tar", "-o", str(archive),
                    commit, *_PACKAGES], check=True, capture_output=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    if (dest / _PUBLIC).is_dir():
        namespace = dest / "compactd"
        namespace.mkdir()
        for module in (dest / _PUBLIC).glob("*.py"):
            shutil.copy2(module, namespace / module.name)
        for package in _PACKAGES:
            (dest / package).rename(namespace / package)
    # Compiled here once: every process the release starts (its CLI, its workers) would
    # otherwise compile its modules again where PYTHONDONTWRITEBYTECODE is set, as ops/test's
    # compileall does for the tree under test.
    if not compileall.compile_dir(dest, quiet=1):
        pytest.fail(f"release {commit}'s code does not compile under {dest}")
    return dest


def release_env(tree: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (the environment by default) with ``tree`` first on the import path."""
    base = dict(os.environ if env is None else env)
    base["PYTHONPATH"] = str(tree)
    base[MODULE_PREFIX_ENV] = module_prefix(tree)
    return base
