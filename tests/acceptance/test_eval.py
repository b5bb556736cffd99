"""``compactd eval`` on the user's path: two configurations over the transcripts under
tests/fixtures/eval write a report whose page a headless chromium (Debian's, never a downloaded
one) shows with both configurations and their charts; its figures are those
``tests/bench/corpus.py`` measures on the same settings; bad input is refused naming the file
and the line (a transcript) or the file (a configuration), exit 2, and the configured database
(SQLite or PostgreSQL) is never touched, whatever the outcome."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compactd.storage.database import embedded_url
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from compactd.worker.replay import read_transcript, session_of
from tests.conftest import REPO, missing, run_cli
from tests.support.services import debian_packages_settled

pytestmark = [pytest.mark.slow]

FIXTURES = REPO / "tests" / "fixtures" / "eval"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# Low triggers, so the few-KB fixtures compact; the lead off and the keep at the claim, so when
# a run fires and what it keeps do not depend on how fast the machine replays (keep_at: pickup
# keeps less by the growth per second it measures).
POLICIES = {
    "roomy": {"trigger": {"type": "tokens", "value": 1500},
              "keep": {"type": "messages", "value": 6}, "lead": 0, "keep_at": "claim"},
    "tight": {"trigger": {"type": "tokens", "value": 700},
              "keep": {"type": "messages", "value": 4}, "lead": 0, "keep_at": "claim"},
}
COMPARED = ("calls", "compactions", "input_tokens", "final_tokens", "coverage",
            "coverage_of_original", "summary_carried", "retention", "facts")


def _configs(tmp_path: Path) -> list[Path]:
    out = []
    for name, policy in POLICIES.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps({"summarization": policy}), encoding="utf-8")
        out.append(path)
    return out


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The user's environment: a configured database under their home, which eval must not
    create or open."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
    home = tmp_path / "home"
    home.mkdir()
    return {**clean, "COMPACTD_HOME": str(home)}


def _eval(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(env, "eval", *args, check=False, timeout=300)


def _dom(page: Path) -> str:
    debian_packages_settled()
    if not Path(CHROMIUM).exists():
        missing(f"{CHROMIUM} is missing (apt-get install chromium chromium-driver)")
    out = subprocess.run([CHROMIUM, *CHROMIUM_ARGS, "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.browser
def test_two_configurations_write_a_report_a_browser_shows(tmp_path: Path,
                                                           env: dict[str, str]) -> None:
    report = tmp_path / "report"
    out = _eval(env, str(FIXTURES), *[a for c in _configs(tmp_path) for a in ("--config", str(c))],
                "--report", str(report))
    assert out.returncode == 0, out.stderr
    assert re.search(r"compactions\s+\d+\s+\d+", out.stdout), out.stdout
    data = json.loads((report / "report.json").read_text())
    roomy, tight = data["configs"]
    assert [roomy["name"], tight["name"]] == ["roomy", "tight"]
    assert roomy["sessions"] == tight["sessions"] == 2
    # The lower trigger compacts more, so more ranges are replaced and probed.
    assert tight["compactions"] > roomy["compactions"] > 0
    assert tight["probes"]["probes"] > roomy["probes"]["probes"] > 0
    for config in data["configs"]:
        assert config["coverage"] == 1.0
        assert config["cost"]["usd"] == 0.0  # the local summarizer bills nothing
        kinds = config["probes"]["by_kind"]
        assert all(kinds[k]["probes"] > 0 for k in ("ids", "paths", "errors", "numbers",
                                                     "instructions")), kinds
        assert config["compression"] > 1
    dom = _dom(report / "index.html")
    header = re.search(r'<table id="figures"><tbody><tr><th></th>(.*?)</tr>', dom)
    assert header is not None, dom[:2000]
    assert re.findall(r"<th>([^<]*)</th>", header.group(1)) == ["roomy", "tight"]
    assert dom.count("<svg") == 2
    assert "tight (" in dom and "roomy (" in dom  # the probe chart labels each bar
    assert not (Path(env["COMPACTD_HOME"]) / "compactd.sqlite3").exists()
    assert not list(Path(env["COMPACTD_HOME"]).iterdir())


def test_figures_agree_with_the_corpus_bench_on_the_same_settings(
        tmp_path: Path, env: dict[str, str]) -> None:
    corpus = pytest.importorskip("tests.bench.corpus")  # langchain: the [dev] extra
    from tests.bench.common import prepare_sqlite

    report = tmp_path / "report"
    paths = sorted(FIXTURES.glob("*.jsonl"))
    configs = _configs(tmp_path)
    out = _eval(env, *map(str, paths), *[a for c in configs for a in ("--config", str(c))],
                "--report", str(report))
    assert out.returncode == 0, out.stderr
    data = json.loads((report / "report.json").read_text())
    for config, (name, policy) in zip(data["configs"], POLICIES.items(), strict=True):
        url = prepare_sqlite(tmp_path / f"bench-{name}")
        for row, path in zip(config["by_session"], paths, strict=True):
            session = session_of(path.stem, path.parent.name, read_transcript(path))
            bench = asyncio.run(corpus.run_compactd(session, url, policy)).report()
            assert {k: row[k] for k in COMPARED} == {k: bench[k] for k in COMPARED}, name
            assert bench["tool_pair_errors"] == 0


def _transcript_with_a_bad_line(tmp_path: Path) -> Path:
    lines = (FIXTURES / "airline-change.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-1]  # the closing brace of line 3
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_bad_input_names_the_file_and_changes_nothing(
        backend: str, tmp_path: Path, env: dict[str, str],
        request: pytest.FixtureRequest) -> None:
    url = embedded_url(Path(env["COMPACTD_HOME"]))
    if backend == "postgres":
        url = request.getfixturevalue("clean_pg")
        env = {**env, "COMPACTD_DATABASE_URL": url}
    else:
        run_cli(env, "migrate")
    kept = [{"role": "user", "content": "the user's own session"}]
    asyncio.run(_append(url, kept))
    before = asyncio.run(_sessions(url))
    configs = _configs(tmp_path)

    broken = _transcript_with_a_bad_line(tmp_path)
    report = tmp_path / "report"
    out = _eval(env, str(FIXTURES / "coding-export.jsonl"), str(broken),
                "--config", str(configs[0]), "--report", str(report))
    assert out.returncode == 2, out.stderr
    assert f"{broken}: line 3: invalid JSON" in out.stderr
    assert "Traceback" not in out.stderr
    assert not report.exists()

    gone = tmp_path / "gone.yaml"
    out = _eval(env, str(FIXTURES), "--config", str(configs[0]), "--config", str(gone),
                "--report", str(report))
    assert out.returncode == 2
    assert f"--config {gone}: no such file" in out.stderr
    assert not report.exists()

    out = _eval(env, str(FIXTURES), "--config", str(configs[1]))
    assert out.returncode == 0, out.stderr
    assert asyncio.run(_sessions(url)) == before


def test_a_run_model_no_configuration_or_tokenizer_knows_is_refused_naming_it(
        tmp_path: Path, env: dict[str, str]) -> None:
    # A typo would be counted as an unknown model (o200k, no window) without a word.
    roomy = _configs(tmp_path)[0]
    report = tmp_path / "report"
    out = _eval(env, str(FIXTURES / "coding-export.jsonl"), "--config", str(roomy),
                "--run-model", "a b", "--report", str(report))
    assert out.returncode == 2, out.stderr
    assert out.stderr == (f"compactd: --run-model: 'a b' is not in models of --config {roomy}, "
                          "and is no OpenAI or Anthropic model name the tokenizer knows\n")
    assert not report.exists()
    # A configured model's name, or one the tokenizer knows, is taken.
    named = tmp_path / "named.yaml"
    named.write_text(json.dumps({"models": [{"name": "a b", "provider": "local"}],
                                 "summarization": POLICIES["roomy"]}))
    for config, model in ((named, "a b"), (roomy, "claude-sonnet-4-5"), (roomy, "gpt-4o")):
        out = _eval(env, str(FIXTURES / "coding-export.jsonl"), "--config", str(config),
                    "--run-model", model, "--json")
        assert out.returncode == 0, (model, out.stderr)
        assert json.loads(out.stdout)["run_model"] == model


def test_a_report_folder_that_cannot_be_written_is_refused_before_the_replays(
        tmp_path: Path, env: dict[str, str]) -> None:
    """A --report under a file (or any place no folder can be made) is bad input found before
    the replays run, not a traceback after them that loses the whole evaluation; and a missing
    chart library is said before them too."""
    configs = _configs(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n", encoding="utf-8")
    report = blocker / "report"
    out = _eval(env, str(FIXTURES / "airline-change.jsonl"), "--config", str(configs[0]),
                "--report", str(report), "--json")
    assert out.returncode == 2, out.stderr
    assert f"--report {report}: {blocker} is not a folder" in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""

    out = _eval_without_matplotlib(env, str(configs[0]), "--report", str(tmp_path / "report"))
    assert out.returncode == 2, out.stderr
    assert "pip install 'compactd[eval]'" in out.stderr
    assert out.stdout == ""
    assert not (tmp_path / "report").exists()


def _eval_without_matplotlib(env: dict[str, str], config: str,
                             *args: str) -> subprocess.CompletedProcess[str]:
    """``compactd eval`` of the airline fixture under ``config`` (with ``args``, then --json) in
    a process where matplotlib cannot be imported, as on a plain install."""
    argv = ["compactd", "eval", str(FIXTURES / "airline-change.jsonl"), "--config", config,
            *args, "--json"]
    probe = ("import sys, runpy; sys.modules['matplotlib'] = None; "
             f"sys.argv = {argv!r}; "
             "runpy.run_module('compactd.scheduler.cli', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", probe], env=env,
                          capture_output=True, text=True, timeout=300)


async def _append(url: str, messages: list[dict[str, Any]]) -> None:
    store = Store.from_url(url)
    try:
        await store.create_session("users-own")
        await store.append("users-own", [parse_openai(m) for m in messages])
    finally:
        await store.close()


async def _sessions(url: str) -> list[tuple[str, int]]:
    store = Store.from_url(url)
    try:
        infos = [await store.get_session(s.id) for s in await store.list_sessions()]
        return [(i.id, i.last_seq) for i in infos]
    finally:
        await store.close()


def test_report_needs_matplotlib_only_when_asked(tmp_path: Path, env: dict[str, str]) -> None:
    """Without --report, no chart library is imported: the CLI runs on a plain install."""
    configs = _configs(tmp_path)
    out = _eval_without_matplotlib(env, str(configs[0]))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["configs"][0]["name"] == "roomy"


def test_a_configured_model_is_called_and_its_usage_priced(
        tmp_path: Path, env: dict[str, str], fake: Any) -> None:
    """With a model in the configuration the eval calls it (here the fake provider over HTTP,
    the official SDK) and prices its usage at the configuration's ``prices:``."""
    from tests.support.stack import FAKE_KEY_ENV, fake_models

    price = {"input": 2.0, "cached_input": 0.5, "output": 8.0}
    config = tmp_path / "priced.yaml"
    config.write_text(json.dumps({
        "models": fake_models(fake.url)[:1], "prices": {"fake-gpt": price},
        "summarization": {**POLICIES["roomy"], "model_name": "fake-gpt"}}))
    out = _eval({**env, FAKE_KEY_ENV: "test-key"}, str(FIXTURES / "coding-export.jsonl"),
                "--config", str(config), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)["configs"][0]
    calls = fake.requests_for(model="fake-gpt")
    assert result["calls"] == len(calls) > 0
    usage = result["usage"]
    assert usage["by_candidate"]["fake-gpt"]["calls"] == len(calls)
    fresh = usage["input_tokens"] - usage["cached_tokens"] - usage["cache_write_tokens"]
    expected = (fresh * price["input"] + usage["cached_tokens"] * price["cached_input"]
                + usage["output_tokens"] * price["output"]) / 1e6
    assert usage["output_tokens"] > 0
    assert result["cost"]["usd"] == pytest.approx(expected, abs=1e-6)
    assert result["cost"]["usd"] > 0


def test_a_run_that_committed_a_round_and_then_failed_is_a_failed_run(
        tmp_path: Path, env: dict[str, str], fake: Any) -> None:
    """A partial run (a round's checkpoint committed, the next round's call refused) is a
    failed run in the report, as ``compactd status`` lists it with the failures."""
    from tests.support.fake_provider import Behaviour
    from tests.support.stack import FAKE_KEY_ENV, fake_models

    # Each round summarizes what fits the summarizer's budget (shrink), so the first run's
    # first round cannot relieve the session; its second call is refused (400: no retry), and
    # every later call answers.
    fake.script(Behaviour(model="fake-gpt"), Behaviour(model="fake-gpt", status=400))
    config = tmp_path / "partial.yaml"
    config.write_text(json.dumps({
        "models": fake_models(fake.url)[:1], "worker": {"local_fallback": False},
        "summarization": {**POLICIES["tight"], "model_name": "fake-gpt", "strategy": "shrink",
                          "trim_tokens_to_summarize": 800}}))
    out = _eval({**env, FAKE_KEY_ENV: "test-key"}, str(FIXTURES / "coding-export.jsonl"),
                "--config", str(config), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)["configs"][0]
    statuses = [r.status for r in fake.requests_for(model="fake-gpt")]
    assert statuses[:2] == [200, 400] and set(statuses[2:]) <= {200}, statuses
    # The first run is partial; every later one committed.
    assert (result["failed"], result["calls"]) == (1, len(statuses)), result
