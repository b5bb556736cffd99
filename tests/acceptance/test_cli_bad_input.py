"""The CLI refuses bad input before it writes anything: exit 2 and one line naming the problem
(the argument or flag), never a traceback, a driver's message or SQL. Run through ``main()``
(fast, many cases) and as a subprocess where the process boundary matters (arguments that are
not UTF-8), on the embedded SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from compactd.scheduler.cli import main
from compactd.storage.database import SQLITE_FILENAME, embedded_url
from compactd.storage.instructions import MAX_INSTRUCTION_CHARS
from compactd.storage.store import Store
from tests.conftest import run_cli

Cli = Callable[..., tuple[int, str, str]]
LINE = json.dumps({"role": "user", "content": "hello"}) + "\n"


class Run:
    def __init__(self, url: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.url = url
        self._capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own usage errors
            code = int(exc.code or 0)
        out = self._capsys.readouterr()
        return code, out.out, out.err

    def session_ids(self) -> list[str]:
        async def read() -> list[str]:
            store = Store.from_url(self.url)
            try:
                return [s.id for s in await store.list_sessions()]
            finally:
                await store.close()

        return asyncio.run(read())


@pytest.fixture(params=["sqlite", "postgres"])
def cli(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> Run:
    for name in list(os.environ):
        if name.startswith("COMPACTD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COMPACTD_HOME", str(tmp_path))
    url = embedded_url(tmp_path)
    if request.param == "postgres":
        url = request.getfixturevalue("clean_pg")
        monkeypatch.setenv("COMPACTD_DATABASE_URL", url)
    run = Run(url, capsys)
    code, _, err = run("migrate")
    assert code == 0, err
    return run


@pytest.fixture
def transcript(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(LINE)
    return path


def assert_refused(result: tuple[int, str, str], *names: str) -> None:
    code, out, err = result
    assert code == 2, (code, out, err)
    assert err.startswith("compactd: ") or err.startswith("usage: "), err
    assert "Traceback" not in err and out == "", (out, err)
    for name in names:
        assert name in err, (name, err)


# ------------------------------------------------------------------------------------------
# session ids and tenants


@pytest.mark.parametrize(("session", "problem"), [
    ("a\x01b", "control character"),
    ("a\0b", "control character"),
    ("a\x85b", "control character"),
    ("a\udcffb", "UTF-8"),  # what Python makes of a byte that is not UTF-8 in argv
    ("a\ufffdb", "U+FFFD"),
    ("  ", "blank"),
    ("x" * 256, "255"),
])
def test_a_session_id_http_would_refuse_exits_2_on_every_command_and_stores_nothing(
        cli: Run, transcript: Path, session: str, problem: str) -> None:
    assert_refused(cli("ingest", str(transcript), "--session", session), "session", problem)
    for command in (["surface", session], ["status", session], ["verify", session],
                    ["plan", session], ["compact", session, "--inline"],
                    ["lease", "release", session]):
        assert_refused(cli(*command), "session", problem)
    assert cli.session_ids() == []


@pytest.mark.parametrize(("tenant", "problem"), [
    ("t\0", "control character"), ("t\x1b[2J", "control character"), ("", "blank")])
def test_a_tenant_http_would_refuse_exits_2_and_stores_nothing(
        cli: Run, transcript: Path, tenant: str, problem: str) -> None:
    assert_refused(cli("ingest", str(transcript), "--session", "s1", "--tenant", tenant),
                   "--tenant", problem)
    assert cli.session_ids() == []


@pytest.mark.parametrize(("args", "flag"), [
    (["ingest", "{file}", "--session", "s1", "--run-model", "gpt\0"], "--run-model"),
    (["recompact", "--dry-run", "--run-model", "gpt\x1b"], "--run-model"),
    (["lease", "release", "s1", "--by", "ops\0"], "--by"),
    (["lease", "release", "s1", "--run", "\udcff"], "--run"),
])
def test_other_names_that_reach_a_column_follow_the_same_rule(
        cli: Run, transcript: Path, args: list[str], flag: str) -> None:
    assert_refused(cli(*[a.replace("{file}", str(transcript)) for a in args]), flag)
    assert cli.session_ids() == []


@pytest.mark.parametrize(("content", "line", "problem"), [
    (b"s1\ns\xff2\n", 2, "UTF-8"),
    (b"s1\n\ns\x002\n", 3, "control character"),
])
def test_a_session_file_with_an_id_http_would_refuse_exits_2_naming_its_line(
        cli: Run, tmp_path: Path, content: bytes, line: int, problem: str) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_bytes(content)
    assert_refused(cli("recompact", "--dry-run", "--session-file", str(ids)),
                   f"line {line}", "session-file", problem)


def test_an_argument_that_is_not_utf8_exits_2_as_a_process(
        cli_env: dict[str, str], transcript: Path) -> None:
    # subprocess encodes the lone surrogate back to the byte 0xFF in the child's argv.
    out = run_cli(cli_env, "ingest", str(transcript), "--session", "x\udcffy", check=False)
    assert out.returncode == 2, out.stderr
    assert "UTF-8" in out.stderr and "Traceback" not in out.stderr
    assert run_cli(cli_env, "verify", "--all", "--json").stdout.count('"sessions": 0') == 1


@pytest.mark.parametrize(("args", "named"), [
    (["recompact", "--resume", "job\udcff"], "--resume"),
    (["recompact", "--dry-run", "--tenant", "t\udcff"], "--tenant"),
    (["history", "search", "s1", "disk \udcff full"], "QUERY"),
])
def test_a_name_or_query_that_is_not_utf8_exits_2_naming_it_as_a_process(
        cli_env: dict[str, str], clean_pg: str, args: list[str], named: str) -> None:
    # On PostgreSQL, which refuses such text in a statement ("database error", exit 1, before).
    env = {**cli_env, "COMPACTD_DATABASE_URL": clean_pg}
    run_cli(env, "ingest", str(_transcript(cli_env)), "--session", "s1")
    before = run_cli(env, "verify", "--all", "--json").stdout
    out = run_cli(env, *args, check=False)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert named in out.stderr and "UTF-8" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "database" not in out.stderr, out.stderr
    assert run_cli(env, "verify", "--all", "--json").stdout == before
    assert run_cli(env, "status", "--json").stdout.count('"bulk_jobs": []') == 1


def _transcript(env: dict[str, str]) -> Path:
    path = Path(env["COMPACTD_HOME"]) / "t.jsonl"
    path.write_text(LINE)
    return path


# ------------------------------------------------------------------------------------------
# numbers and durations


@pytest.mark.timeout(60)  # on the code before the fix --timeout nan waited forever
@pytest.mark.parametrize(("args", "flag"), [
    (["ingest", "{file}", "--session", "s1", "--context-window", "3000000000"],
     "--context-window"),
    (["ingest", "{file}", "--session", "s1", "--context-window", "0"], "--context-window"),
    (["ingest", "{file}", "--session", "s1", "--context-window", "-5"], "--context-window"),
    (["status", "s1", "--limit", "-1"], "--limit"),
    (["status", "s1", "--limit", "0"], "--limit"),
    (["status", "s1", "--limit", "99999999999"], "--limit"),
    (["status", "--since", "99999999999999d"], "--since"),
    (["status", "--since", "soon"], "--since"),
    (["recompact", "--dry-run", "--idle-for", "99999999999999d"], "--idle-for"),
    (["recompact", "--dry-run", "--min-tokens", "-1"], "--min-tokens"),
    (["recompact", "--dry-run", "--min-tokens", "100000000000000000000"], "--min-tokens"),
    (["recompact", "--dry-run", "--chunk", "0"], "--chunk"),
    (["compact", "s1", "--wait", "--timeout", "nan"], "--timeout"),
    (["compact", "s1", "--wait", "--timeout", "inf"], "--timeout"),
    (["compact", "s1", "--wait", "--timeout", "-1"], "--timeout"),
    (["compact", "s1", "--wait", "--timeout", "0"], "--timeout"),
    (["serve", "--port", "70000"], "--port"),
])
def test_a_number_a_flag_cannot_use_exits_2_naming_the_flag_and_writes_nothing(
        cli: Run, transcript: Path, args: list[str], flag: str) -> None:
    argv = [a.replace("{file}", str(transcript)) for a in args]
    assert_refused(cli(*argv), f"argument {flag}")
    assert cli.session_ids() == []


@pytest.mark.parametrize("how", [[], ["--inline"]])
def test_a_timeout_without_wait_exits_2_naming_it_and_queues_nothing(
        cli: Run, transcript: Path, how: list[str]) -> None:
    # Only --wait waits: the timeout was dropped without a word, the run queued or run.
    code, _, err = cli("ingest", str(transcript), "--session", "s1")
    assert code == 0, err
    assert_refused(cli("compact", "s1", *how, "--timeout", "5"), "--timeout", "--wait")

    async def queued() -> str:
        store = Store.from_url(cli.url)
        try:
            return await store.mark_manual("s1", "probe", ttl_s=120)
        finally:
            await store.close()

    assert asyncio.run(queued()) == "probe", "no manual run was queued"


def test_the_largest_context_window_the_column_holds_is_accepted(cli: Run,
                                                                 transcript: Path) -> None:
    code, _, err = cli("ingest", str(transcript), "--session", "s1", "--context-window",
                       "2147483647", "--json")
    assert code == 0, err
    assert cli.session_ids() == ["s1"]
    code, out, err = cli("status", "s1", "--limit", "1", "--json")
    assert code == 0 and json.loads(out)["session"] == "s1", err
    code, out, err = cli("status", "--since", "36500d", "--json")
    assert code == 0 and "recent" in json.loads(out), err


# ------------------------------------------------------------------------------------------
# a broker that cannot be reached


@pytest.mark.parametrize("command", [["compact", "s1"], ["compact", "s1", "--wait"],
                                     ["recompact", "--force", "--no-wait"]])
def test_a_broker_that_cannot_be_reached_is_one_line_naming_it_without_its_password(
        cli_env: dict[str, str], transcript: Path, command: list[str]) -> None:
    run_cli(cli_env, "ingest", str(transcript), "--session", "s1")
    cli_env["COMPACTD_BROKER_URL"] = "redis://compactd:hunter2@127.0.0.1:1/0"  # a closed port
    out = run_cli(cli_env, *command, check=False)
    # Exit 1: an operational error, like a database that cannot be reached (DESIGN.md).
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("compactd: the broker cannot be reached at "
                                 "redis://compactd:***@127.0.0.1:1/0"), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "hunter2" not in out.stderr + out.stdout


@pytest.mark.parametrize(("broker", "problem"), [
    ("foo://compactd:hunter2@host/0", "unknown broker transport 'foo'"),
    ("redis://compactd:hunter2@127.0.0.1:notaport/0", "Port could not be cast"),
    ("compactd:hunter2@127.0.0.1", "unknown broker transport"),
])
def test_a_broker_url_kombu_cannot_use_exits_2_without_a_traceback(
        cli: Run, transcript: Path, monkeypatch: pytest.MonkeyPatch, broker: str,
        problem: str) -> None:
    assert cli("ingest", str(transcript), "--session", "s1")[0] == 0
    monkeypatch.setenv("COMPACTD_BROKER_URL", broker)
    for command in (["compact", "s1"], ["signal", "s1"]):
        code, out, err = cli(*command)
        assert_refused((code, out, err), "COMPACTD_BROKER_URL", problem)
        assert "hunter2" not in err


@pytest.mark.parametrize("args", [["surface", "s1"], ["surface", "s1", "--json"],
                                  ["plan", "s1"], ["verify", "s1"], ["status", "s1"],
                                  ["history", "search", "s1", "x"]])
def test_a_read_of_a_home_without_a_database_creates_no_file(
        args: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A command that only reads one session answers that it does not exist, without creating
    and migrating the embedded database to find out."""
    for name in list(os.environ):
        if name.startswith("COMPACTD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COMPACTD_HOME", str(tmp_path))
    code, out, err = Run(embedded_url(tmp_path), capsys)(*args)
    assert code == 2, (code, out, err)
    assert "session 's1' does not exist" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------
# a manual run's instructions


def test_instructions_over_the_bound_exit_2_and_an_inline_run_records_them(
        cli: Run, tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"role": "user" if i % 2 == 0 else "assistant",
                                        "content": f"message {i} " + "words " * 200}) + "\n"
                            for i in range(30)))
    assert cli("ingest", str(path), "--session", "s1")[0] == 0
    before = json.loads(cli("surface", "s1", "--json")[1])
    too_long = "x" * (MAX_INSTRUCTION_CHARS + 1)
    for how in ("--inline", "--wait"):
        assert_refused(cli("compact", "s1", how, "--instructions", too_long),
                       "instructions", f"at most {MAX_INSTRUCTION_CHARS}")
    assert json.loads(cli("surface", "s1", "--json")[1]) == before
    code, out, err = cli("compact", "s1", "--inline", "--json", "--instructions",
                         "keep the failing test's name")
    assert code == 0, err
    result = json.loads(out)
    assert result["outcome"] == "committed"
    assert result["instructions"] == ["keep the failing test's name"]
    status = json.loads(cli("status", "s1", "--json")[1])
    assert status["runs"][0]["instructions"] == ["keep the failing test's name"]


@pytest.mark.parametrize(("database", "problem"), [
    ("postgresql://compactd:hunter2@127.0.0.1:1,127.0.0.1:notaport/db",
     "port of host '127.0.0.1' must be a number"),
    ("postgresql://compactd:hunter2@127.0.0.1:1,127.0.0.1:2/db?target_session_attrs=bogus",
     "target_session_attrs must be one of"),
])
def test_a_database_host_list_the_driver_cannot_use_exits_2_naming_it_without_a_traceback(
        cli_env: dict[str, str], database: str, problem: str) -> None:
    cli_env["COMPACTD_DATABASE_URL"] = database
    for command in (["status"], ["surface", "s1"], ["migrate"]):
        out = run_cli(cli_env, *command, check=False)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("compactd: database URL: ") and problem in out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
        assert "hunter2" not in out.stderr + out.stdout


def test_a_database_that_does_not_exist_exits_2_naming_it_at_once(
        cli_env: dict[str, str], pg_url: str) -> None:
    # An operator's typo: not an outage to wait out (exit 1 after retries), but bad config.
    missing = pg_url.rsplit("/", 1)[0] + "/compactd_no_such_database"
    cli_env["COMPACTD_DATABASE_URL"] = missing
    for command in (["status"], ["surface", "s1"], ["migrate"]):
        out = run_cli(cli_env, *command, check=False)
        assert out.returncode == 2, out.stderr
        assert "'compactd_no_such_database' does not exist" in out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("option", ["sslmode=disable", "sslmode=prefer", "ssl=prefer",
                                    "application_name=compactd-ops"])
def test_libpq_options_an_operator_puts_in_the_url_reach_the_database(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], clean_pg: str,
        option: str) -> None:
    # sslmode is what a managed PostgreSQL's connection string carries; asyncpg calls it ssl.
    monkeypatch.setenv("COMPACTD_DATABASE_URL", f"{clean_pg}?{option}")
    result = Run(clean_pg, capsys)("status", "--json")
    assert result[0] == 0, result
    assert json.loads(result[1])["runs"]["committed"] == 0


@pytest.mark.parametrize(("option", "problem"), [
    ("sslmode=sometimes", "sslmode must be one of disable, allow, prefer, require"),
    ("ssl=yes", "ssl must be one of disable, allow, prefer, require"),
    ("pool_size=5", "'pool_size' is not an option compactd can pass to the driver"),
])
def test_a_url_option_the_driver_cannot_use_exits_2_naming_it_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], pg_url: str,
        option: str, problem: str) -> None:
    monkeypatch.setenv("COMPACTD_DATABASE_URL", f"{pg_url}?{option}")
    for command in (["status"], ["surface", "s1"], ["migrate"]):
        assert_refused(Run(pg_url, capsys)(*command), "database URL: ", problem)


@pytest.mark.parametrize(("database", "problem"), [
    ("mysql://compactd:hunter2@127.0.0.1/db", "unsupported database URL mysql://"),
    ("compactd:hunter2@127.0.0.1/db", "database URL: no scheme"),
])
def test_a_database_url_no_backend_takes_exits_2_naming_it_without_its_password(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        database: str, problem: str) -> None:
    # A typo in the operator's configuration (exit 2), not an outage (exit 1).
    monkeypatch.setenv("COMPACTD_HOME", str(tmp_path))
    monkeypatch.setenv("COMPACTD_DATABASE_URL", database)
    for command in (["status"], ["surface", "s1"], ["migrate"]):
        result = Run(database, capsys)(*command)
        assert_refused(result, problem)
        assert "hunter2" not in result[2]


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["verify", "--all"]])
@pytest.mark.parametrize("how", ["url", "home"])
def test_a_read_of_a_mistyped_sqlite_path_exits_2_naming_it_and_creates_no_file(
        args: list[str], how: str, bare_cli_env: dict[str, str], tmp_path: Path) -> None:
    """A command that reads the whole database (no one session) given a SQLite file that is not
    there (a URL, or a home holding no database) says which path it looked at: creating and
    migrating an empty database there would hide the typo behind an empty answer."""
    env = dict(bare_cli_env)
    if how == "url":
        typo = tmp_path / "typo" / "compactd.sqlit3"
        env["COMPACTD_DATABASE_URL"] = f"sqlite:///{typo}"
    else:
        typo = tmp_path / "typo" / SQLITE_FILENAME
        env["COMPACTD_HOME"] = str(typo.parent)
    out = run_cli(env, *args, check=False)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert str(typo) in out.stderr and "does not exist" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert not typo.exists() and not typo.parent.exists()


def test_a_signal_reason_not_in_the_list_names_the_flag_and_the_choices(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = Run("", capsys)("signal", "s1", "--reason", "")
    assert code == 2, err
    assert "--reason" in err and "'pressure', 'step', 'append'" in err, err
    assert "SignalReason" not in err and "Input should" not in err, err


@pytest.mark.postgres
def test_a_connection_the_server_refuses_says_the_driver_s_reason(
        bare_cli_env: dict[str, str], pg_url: str) -> None:
    """The local PostgreSQL has no SSL: a URL asking for it gets the driver's reason (the
    server refused SSL), not only the class of its error, and still no password."""
    env = dict(bare_cli_env)
    env["COMPACTD_DATABASE_URL"] = pg_url + ("&" if "?" in pg_url else "?") + "sslmode=require"
    out = run_cli(env, "status", check=False)
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.startswith("compactd: the database cannot be reached: "), out.stderr
    assert "SSL" in out.stderr and "Traceback" not in out.stderr, out.stderr
