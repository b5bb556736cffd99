"""tests/support/cli_launcher.py: a command forked from the launcher ends as the same command
in a fresh interpreter does (exit code, stdout, stderr), in its own working directory and
environment, with compactd's modules imported by the command itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compactd.storage.database import SQLITE_FILENAME
from tests.conftest import isolated_cli_env
from tests.support import cli_launcher

LINE = json.dumps({"role": "user", "content": "hello"}) + "\n"


def fresh(env: dict[str, str], args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", cli_launcher.CLI_MODULE, *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [
    ["--help"],
    ["no-such-command"],
    ["surface", "nobody"],
    # A lone surrogate: the argument reaches the command as the byte a fresh interpreter gets.
    ["surface", "caf\udcff"],
    # Relative to the working directory the command is given.
    ["ingest", "t.jsonl", "--session", "s1", "--json"],
])
def test_a_launched_command_ends_as_in_a_fresh_interpreter(args: list[str], tmp_path: Path,
                                                          sqlite_template: Path) -> None:
    ends = []
    for run in ("fresh", "launched"):
        home = tmp_path / run
        home.mkdir()
        shutil.copy(sqlite_template, home / SQLITE_FILENAME)
        (home / "t.jsonl").write_text(LINE)
        env = isolated_cli_env(home)
        out = (fresh(env, args, home) if run == "fresh"
               else cli_launcher.run(env, args, cwd=home, timeout=60))
        ends.append((out.returncode, out.stdout.replace(str(home), "HOME"),
                     out.stderr.replace(str(home), "HOME")))
    assert ends[0] == ends[1]
    assert "Traceback" not in ends[1][2]


def test_a_launched_command_reads_its_own_environment(tmp_path: Path,
                                                      sqlite_template: Path) -> None:
    shutil.copy(sqlite_template, tmp_path / SQLITE_FILENAME)
    config = tmp_path / "compactd.yaml"
    config.write_text("summarization: [not, a, mapping]\n")
    env = {**isolated_cli_env(tmp_path), "COMPACTD_CONFIG": str(config)}
    refused = cli_launcher.run(env, ["surface", "nobody"], cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "summarization" in refused.stderr, refused.stderr
    plain = cli_launcher.run(isolated_cli_env(tmp_path), ["surface", "nobody"], cwd=tmp_path,
                             timeout=60)
    assert plain.stderr == "compactd: session 'nobody' does not exist\n", plain.stderr


def test_a_launched_command_imports_compactd_itself() -> None:
    """The launcher holds only third-party modules: compactd's run in each command, as in a
    fresh interpreter (what they do at import happens per command)."""
    listed = Path(cli_launcher._launcher(sys.executable, dict(os.environ)).dir, "modules")  # type: ignore[union-attr]
    names = listed.read_text().split()
    assert "sqlalchemy" in names
    assert not [name for name in names if name.split(".")[0] == "compactd"]


def test_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    env = isolated_cli_env(tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        cli_launcher.run(env, ["migrate"], cwd=tmp_path, timeout=0.01)


def test_the_switch_runs_commands_in_fresh_interpreters(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv(cli_launcher.SWITCH_ENV, "0")
    monkeypatch.setattr(cli_launcher, "_launcher", None)  # a launcher would fail the test
    out = cli_launcher.run(isolated_cli_env(tmp_path), ["--version"], timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out


def test_a_command_runs_in_a_fresh_interpreter_once_its_launcher_has_ended(
        tmp_path: Path) -> None:
    env = {**isolated_cli_env(tmp_path), "PYTHONHASHSEED": "7"}  # a launcher of its own
    assert cli_launcher.run(env, ["--version"], timeout=60).returncode == 0
    launcher = cli_launcher._launcher(sys.executable, env)
    assert launcher is not None
    launcher.proc.kill()
    launcher.proc.wait()
    out = cli_launcher.run(env, ["--version"], timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("compactd"), out
