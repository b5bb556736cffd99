"""The README's install (`pip install .`, no extras) runs a worker and the CLI, not only the demo.

The suite's own environment has the dev extra, whose tools bring packages of their own, so an
import that only works because of them passes every other test and fails for a user. One did:
kombu's Redis transport imports `packaging`, which kombu declares only under its `redis` extra,
and `celery -A compactd.worker.app worker` died at start on a plain install (the Docker image's
too).
Here a fresh venv gets compactd with no extra, as `pip install .` gives it (the wheel pip builds
from a copy of the repository, installed: the run's one, shared with the wheel's test, see
tests/support/install.py), and its interpreter, with the repository off its path, imports every
module and runs a queued compaction through a worker.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from compactd import scheduler, storage, worker
from compactd.scheduler.samples import coding_session
from tests.support.install import installed_compactd
from tests.support.stack import REPO, Stack

pytestmark = pytest.mark.timeout(600)

# Each package's folder, and its import name (pyproject maps the folders to the names).
PACKAGES = {"storage": storage.__name__, "worker": worker.__name__,
            "scheduler": scheduler.__name__}
# A module that needs an extra: the plain install leaves it out on purpose.
NEEDS_AN_EXTRA = {"compactd.scheduler.langchain"}


@pytest.fixture(scope="module")
def plain_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_compactd(tmp_path_factory).python


def _modules() -> list[str]:
    names = []
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if "migrations" in path.parts or "public" in path.parts:
                continue  # alembic runs the migrations as scripts; public/ is another package's
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            names.append(".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    # The compactd namespace's own modules (compactd.client): see pyproject's package-dir.
    public = REPO / "scheduler" / "public"
    names += [f"compactd.{path.stem}" for path in sorted(public.glob("*.py"))]
    return [name for name in names if name not in NEEDS_AN_EXTRA]


def test_every_module_imports_from_the_plain_install(plain_python: Path, tmp_path: Path) -> None:
    script = ("import importlib, json, sys\n"
              "failed = {}\n"
              "for name in json.loads(sys.argv[1]):\n"
              "    try:\n"
              "        module = importlib.import_module(name)\n"
              "        assert '/site-packages/' in module.__file__, module.__file__\n"
              "    except Exception as exc:\n"
              "        failed[name] = repr(exc)\n"
              "print(json.dumps(failed))\n")
    done = subprocess.run([str(plain_python), "-c", script, json.dumps(_modules())],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {}


def test_a_queued_compaction_runs_on_a_worker_of_the_plain_install(
        plain_python: Path, make_stack: Callable[..., Stack]) -> None:
    stack = make_stack(python=plain_python, summarization={
        "trigger": [{"type": "tokens", "value": 8000}],
        "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"})
    stack.start_worker("w1", concurrency=2, ready_timeout=60)
    stack.ingest("s1", coding_session(steps=20, big_output_lines=30).messages)
    result = stack.cli_json("compact", "s1", "--wait", "--timeout", "60")
    assert result["outcome"] == "committed", result
    assert "1/1 sessions verified" in stack.cli("verify", "s1").stdout
