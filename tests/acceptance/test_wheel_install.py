"""One namespace (issue 28): the wheel installs compactd.worker, compactd.scheduler and
compactd.storage, never a top-level worker, scheduler or storage. A Celery project has its own
worker.py (its Celery app's module), often a storage/ package too; compactd beside them must
neither shadow them nor be shadowed.

Here the wheel is built from a copy of the repository and installed into a fresh venv (the
run's one, shared with the plain install's test: tests/support/install.py), and in a project
directory holding its own worker.py and storage/ package, the directory every process starts in
(`python -m` and `celery -A` put it first on the path), a real `celery -A compactd.worker.app
worker` runs a queued compaction the CLI asked for, and one interpreter imports the project's
modules beside compactd's.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from tests.support.install import installed_compactd
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(600)

PROJECT_WORKER = '''"""The project's own Celery app."""
from celery import Celery

from storage import OWNER  # namespace: keep

app = Celery(OWNER, broker="memory://")
'''
PROJECT_STORAGE = 'OWNER = "the project"\n'


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_compactd(tmp_path_factory).wheel


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_compactd(tmp_path_factory).python


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"compactd"}


def test_a_project_with_its_own_worker_and_storage_runs_compactd_beside_them(
        wheel_python: Path, make_stack: Callable[..., Stack]) -> None:
    stack = make_stack(python=wheel_python, summarization={
        "trigger": [{"type": "tokens", "value": 8000}],
        "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"})
    project = stack.home  # every process the stack starts runs here
    (project / "worker.py").write_text(PROJECT_WORKER)
    (project / "storage").mkdir()
    (project / "storage" / "__init__.py").write_text(PROJECT_STORAGE)

    proc = stack.start_worker("w1", concurrency=2, ready_timeout=60)
    assert proc.args[proc.args.index("-A") + 1] == "compactd.worker.app"
    stack.ingest("s1", coding_session(steps=20, big_output_lines=30).messages)
    result = stack.cli_json("compact", "s1", "--wait", "--timeout", "60")
    assert result["outcome"] == "committed", result
    assert "1/1 sessions verified" in stack.cli("verify", "s1").stdout

    # The project's modules by their own names (namespace: keep tells the migration so).
    script = ("import json, worker, storage, compactd.worker.app, compactd.storage.store\n"
              "from compactd.client import CompactdClient\n"
              "print(json.dumps([worker.app.main, storage.OWNER,\n"  # namespace: keep
              "                  compactd.worker.app.__file__, compactd.storage.store.__file__,\n"
              "                  CompactdClient.__module__]))\n")
    done = subprocess.run([str(wheel_python), "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=project, env={**stack.env, "HOME": str(project)})
    assert done.returncode == 0, done.stderr[-3000:]
    app_main, owner, app_file, store_file, client_module = json.loads(done.stdout)
    assert (app_main, owner) == ("the project", "the project")
    assert "/site-packages/compactd/worker/" in app_file, app_file
    assert "/site-packages/compactd/storage/" in store_file, store_file
    assert client_module == "compactd.scheduler.client"
