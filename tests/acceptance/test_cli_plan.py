"""``compactd plan``: a dry run over a stored session that writes nothing, in the CLI contract's
shape; and ``compact --inline`` running the same pipeline in the CLI process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from tests.conftest import run_cli as run

SAMPLE = coding_session(steps=16, big_output_lines=220)


def _store_the_sample(env: dict[str, str], home: Path) -> dict[str, str]:
    config = home / "compactd.yaml"
    config.write_text("summarization:\n  trigger: [{type: tokens, value: 6000}]\n"
                      "  keep: {type: messages, value: 6}\n")
    env["COMPACTD_CONFIG"] = str(config)
    path = home / "s.jsonl"
    path.write_text(SAMPLE.jsonl())
    run(env, "migrate")
    run(env, "ingest", str(path), "--session", "s1", "--run-model", "gpt-4o")
    return env


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, cli_env: dict[str, str], tmp_path: Path
        ) -> dict[str, str]:
    """The sample stored afresh, for a test that writes."""
    if request.param == "postgres":
        cli_env["COMPACTD_DATABASE_URL"] = request.getfixturevalue("clean_pg")
    return _store_the_sample(cli_env, tmp_path)


@pytest.fixture(scope="module")
def planned(module_cli_env: dict[str, str]) -> dict[str, str]:
    """The sample stored once per module and kind, for the tests that only plan (a plan writes
    nothing: the first test checks it)."""
    return _store_the_sample(module_cli_env, Path(module_cli_env["COMPACTD_HOME"]))


def state(env: dict[str, str]) -> tuple[str, str]:
    return (run(env, "surface", "s1", "--json").stdout,
            run(env, "status", "s1", "--json").stdout)


def test_plan_json_follows_the_contract_and_writes_nothing(planned: dict[str, str]) -> None:
    before = state(planned)
    body = json.loads(run(planned, "plan", "s1", "--json").stdout)
    assert state(planned) == before
    assert body["session"] == "s1" and body["surface_version"] == 1
    assert set(body["pressure"]) >= {"tokens", "messages", "fraction"}
    assert body["trigger"]["fired"] is True and body["trigger"]["reason"]
    assert body["prune"] and all(set(p) >= {"seq", "tokens_before", "tokens_after"}
                                 for p in body["prune"])
    assert all(p["tokens_after"] < p["tokens_before"] for p in body["prune"])
    saved = sum(p["tokens_before"] - p["tokens_after"] for p in body["prune"])
    assert body["tokens_after_prune"] == body["pressure"]["tokens"] - saved
    summarize = body["summarize"]
    assert summarize is not None
    replaced, kept = summarize["replace_seqs"], summarize["keep_seqs"]
    assert replaced and kept and not set(replaced) & set(kept)
    covered = [s for call in summarize["calls"] for s in call["seqs"]]
    assert sorted(set(covered)) == sorted(replaced)
    assert all(call["input_tokens"] <= 4000 for call in summarize["calls"])


def test_plan_force_and_keep(planned: dict[str, str]) -> None:
    normal = json.loads(run(planned, "plan", "s1", "--json").stdout)["summarize"]
    forced = json.loads(run(planned, "plan", "s1", "--json", "--force").stdout)["summarize"]
    assert len(forced["keep_seqs"]) < len(normal["keep_seqs"])
    wide = json.loads(run(planned, "plan", "s1", "--json", "--keep", "messages:30").stdout)
    assert len(wide["summarize"]["keep_seqs"]) > len(normal["keep_seqs"])
    human = run(planned, "plan", "s1").stdout
    assert "trigger: fired" in human and "summarize: replace" in human


@pytest.mark.parametrize("keep", ["messages", "pages:3", "fraction:80", "messages:-1"])
def test_bad_keep_exits_2(planned: dict[str, str], keep: str) -> None:
    out = run(planned, "plan", "s1", "--keep", keep, check=False)
    assert out.returncode == 2 and "keep" in out.stderr


def test_compact_inline_commits_and_the_log_replays(env: dict[str, str]) -> None:
    out = json.loads(run(env, "compact", "s1", "--inline", "--json").stdout)
    assert out["outcome"] == "committed" and out["failure_class"] is None
    assert out["tokens_after"] < out["tokens_before"]
    assert out["model"] == "local" and out["replaced_seqs"]
    surface = json.loads(run(env, "surface", "s1", "--json").stdout)
    checkpoints = [m for m in surface["messages"] if (m.get("meta") or {}).get("checkpoint")]
    assert [m["role"] for m in checkpoints] == ["user"]  # the data message, the contract in it
    assert "ok   s1" in run(env, "verify", "s1").stdout
    runs = json.loads(run(env, "status", "s1", "--json").stdout)["runs"]
    assert runs[0]["status"] == "committed"
    again = json.loads(run(env, "compact", "s1", "--inline", "--json").stdout)
    assert again["outcome"] == "nothing_to_do"
