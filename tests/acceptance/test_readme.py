"""The README runs as written: its commands are read out of README.md and run, not copied here.

The bare-host block of "Running it for real" runs whole in bash, line for line, with real
PostgreSQL, Redis, a Celery worker, beat and Flower, and ends with ops/examples/agent_loop.py
picking up a checkpoint. Two names in it are this machine's test services instead of a
newcomer's (the database ``compactd`` becomes the test's own, Redis database 0 the test's), and
the environment adds what a shared test machine needs (PGUSER and PGHOST for the test server,
free ports for Flower and the worker's metrics); nothing else of the block is changed.

The compose block cannot run here (no Docker engine): the files it names must exist and the
configuration it mounts must load; tests/unit/test_ops_files.py validates the compose file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.services import drop_database_sync, flush_redis, with_database
from tests.support.stack import REPO, wait_until

README = REPO / "README.md"
VENV_BIN = Path(sys.executable).parent

pytestmark = pytest.mark.timeout(600)


def readme_blocks(heading: str) -> list[str]:
    """The fenced code blocks of the README section that starts at ``heading``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    rest = text[start + len(heading) + 2:]
    level = heading.split(" ", 1)[0]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, flags=re.M)
    section = rest[:end.start()] if end else rest
    return re.findall(r"^```[a-z]*\n(.*?)^```$", section, flags=re.M | re.S)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, len(lines)
    (quick_start,) = readme_blocks("## Quick start")
    assert quick_start.splitlines() == ["pip install . && compactd demo", "ops/test"]
    assert "ops/test" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_every_link_of_the_readme_names_a_file_that_exists() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        assert (REPO / link).exists(), link


def test_the_readme_client_snippet_runs_on_the_embedded_default(tmp_path: Path) -> None:
    (snippet,) = [b for b in readme_blocks("### Your runtime: the client")
                  if "CompactdClient" in b]
    script = tmp_path / "snippet.py"
    script.write_text(snippet, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.fullmatch(r"\d+ tokens, over the trigger: False\n", done.stdout), done.stdout
    assert (tmp_path / "compactd.sqlite3").is_file()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_running_it_for_real_on_one_host_runs_as_written(pg_url: str, redis_url: str,
                                                        tmp_path: Path) -> None:
    (block,) = [b for b in readme_blocks("### On one host, without Docker")
                if "createdb" in b]
    database = urlparse(pg_url).path.lstrip("/") + "_readme"
    redis_db = urlparse(redis_url).path.lstrip("/")
    script = (block.replace("createdb compactd\n", f"createdb {database}\n")
              .replace("postgresql://localhost/compactd\n",
                       f"postgresql://localhost/{database}\n")
              .replace("redis://localhost:6379/0\n", f"redis://localhost:6379/{redis_db}\n"))
    assert script.count(database) == 2 and f"6379/{redis_db}\n" in script, script
    url = with_database(pg_url, database)
    drop_database_sync(url)
    flush_redis(redis_url)
    # The block runs from a directory of its own (beat's schedule and the logs land there) in
    # which ops/ is the repository's: its relative paths resolve as in a clone.
    (tmp_path / "ops").symlink_to(REPO / "ops")
    server = urlparse(pg_url)
    flower_port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "PG"))}
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env['PATH']}", PYTHONPATH=str(REPO),
               PGUSER=server.username or "postgres", PGHOST=server.hostname or "127.0.0.1",
               PGPORT=str(server.port or 5432), FLOWER_PORT=str(flower_port),
               COMPACTD_METRICS_PORT=str(metrics_port))
    (tmp_path / "readme.sh").write_text("set -e\n" + script, encoding="utf-8")
    proc = subprocess.Popen(["bash", "readme.sh"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=420)
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}"
                       for p in sorted(tmp_path.glob("*.log")))
        assert proc.returncode == 0, output + logs
        assert "picked up a new surface" in output and "done:" in output, output
        assert re.search(r"\b[1-9]\d* summary checkpoint", output), output + logs
        # Flower started with the block's credentials and refuses a request without them.
        root = f"http://127.0.0.1:{flower_port}/"
        def refused_without_credentials() -> bool:
            try:
                urllib.request.urlopen(root, timeout=5)
            except urllib.error.HTTPError as exc:
                assert exc.code == 401, exc
                return True
            except OSError:
                return False  # not listening yet
            pytest.fail("Flower answered without credentials")

        wait_until(refused_without_credentials, timeout=60, interval=0.5,
                   what=f"Flower on port {flower_port}{logs}")
        request = urllib.request.Request(root, headers={
            "Authorization": "Basic YWRtaW46Y2hhbmdlLW1l"})  # admin:change-me
        assert urllib.request.urlopen(request, timeout=10).status == 200
        status = subprocess.run(
            ["compactd", "status", "--json"], cwd=tmp_path, capture_output=True, text=True,
            timeout=60, env={**env, "COMPACTD_DATABASE_URL": url,
                             "COMPACTD_CONFIG": "ops/compactd.local.yaml"})
        assert status.returncode == 0, status.stderr
        assert '"committed"' in status.stdout, status.stdout[:2000]
    finally:
        # The worker, beat and Flower the block left in the background: its process group.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        drop_database_sync(url)


def test_the_compose_block_names_files_that_exist_and_a_config_that_loads() -> None:
    (block,) = [b for b in readme_blocks("### With Docker Compose") if "docker compose" in b]
    words = [shlex.split(line) for line in block.splitlines() if line.strip()]
    compose_files = {w[w.index("-f") + 1] for w in words if "-f" in w}
    assert compose_files == {"ops/compose.yaml"}
    assert (REPO / "ops" / "compose.yaml").is_file()
    exports = dict(w[1].split("=", 1) for w in words if w[0] == "export")
    assert exports["FLOWER_BASIC_AUTH"].startswith("admin:")
    # Compose resolves the mount relative to the compose file's directory.
    mounted = (REPO / "ops" / exports["COMPACTD_CONFIG_FILE"]).resolve()
    assert mounted.is_file(), mounted
    compose = (REPO / "ops" / "compose.yaml").read_text(encoding="utf-8")
    assert "${COMPACTD_CONFIG_FILE:-" in compose and "FLOWER_BASIC_AUTH" in compose
    from compactd.worker.settings import load_config

    config = load_config({}, path=str(mounted))
    assert config.policy.model_name == "local"
    assert not any(m.api_key_env for m in config.models)


def _requirement_names(requirements: list[str]) -> set[str]:
    from packaging.requirements import Requirement

    return {Requirement(r).name.lower().replace("_", "-") for r in requirements
            if "extra ==" not in r}


def test_the_langchain_extra_installs_what_the_readme_snippet_imports() -> None:
    """`pip install '.[langchain]'` must bring every package the README's LangChain example
    imports (it lacked langchain-openai): the extra's requirements and theirs, from pyproject
    and the installed packages' metadata."""
    import importlib.metadata
    import tomllib

    (snippet,) = [b for b in readme_blocks("### Your runtime: the client")
                  if "CompactdMiddleware" in b]
    modules = {m.split(".")[0] for m in re.findall(r"^(?:from|import) ([\w.]+)", snippet,
                                                      flags=re.M)} - {"scheduler", "compactd"}
    assert modules == {"langchain", "langchain_openai", "langgraph"}, modules
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = _requirement_names(project["optional-dependencies"]["langchain"])
    closure, todo = set(), list(wanted | _requirement_names(project["dependencies"]))
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            todo += _requirement_names(importlib.metadata.requires(name) or [])
    distributions = importlib.metadata.packages_distributions()
    for module in modules:
        names = {d.lower().replace("_", "-") for d in distributions[module]}
        assert names & closure, (module, names)


def test_the_readme_langchain_snippet_runs_as_written(fake: FakeProvider, tmp_path: Path) -> None:
    """The snippet itself, not an example beside it, runs on the embedded default: its model
    call reaches an OpenAI-compatible server on this host (the fake) through ``OPENAI_BASE_URL``,
    as the README's note says, and the session it names holds the exchange afterwards."""
    (snippet,) = [b for b in readme_blocks("### Your runtime: the client")
                  if "CompactdMiddleware" in b]
    fake.script(Behaviour(model="gpt-4o-mini", output="text", text="A rounding bug in tax.py."))
    script = tmp_path / "snippet.py"
    script.write_text(snippet, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "OPENAI_"))}
    env.update(PYTHONPATH=str(REPO), OPENAI_BASE_URL=fake.openai_base_url,
               OPENAI_API_KEY="sk-fake", COMPACTD_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    surface = subprocess.run([sys.executable, "-m", "compactd.scheduler.cli", "surface",
                              "example-session", "--json"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    assert surface.returncode == 0, surface.stderr
    messages = json.loads(surface.stdout)["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "Why do the tax tests fail?"), ("assistant", "A rounding bug in tax.py.")]
