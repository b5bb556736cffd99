"""Policy configuration as the CLI loads it (a subprocess on the embedded SQLite default): what
would misbehave silently exits 2 naming the key, and what is meant is accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from tests.conftest import run_cli as run

WINDOW_1000 = "models: [{name: small, provider: openai, context_window: 1000}]\n"


def _configured(env: dict[str, str], tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "compactd.yaml"
    path.write_text(text)
    return {**env, "COMPACTD_CONFIG": str(path)}


@pytest.mark.parametrize(("text", "error"), [
    # The default fraction trigger (0.8) against a retain ratio above it.
    ("summarization: {retain_ratio: 0.9}",
     "summarization.retain_ratio: keep fraction>=0.9 (retain_ratio) is not below trigger "
     "fraction>=0.8"),
    # A fraction trigger below the default retain ratio (0.16).
    ("summarization: {trigger: {type: fraction, value: 0.1}}",
     "summarization.retain_ratio: keep fraction>=0.16 (retain_ratio) is not below trigger "
     "fraction>=0.1"),
    # Keep tokens against a fraction of a configured run model's window.
    (WINDOW_1000 + "summarization: {trigger: {type: fraction, value: 0.5}, keep: [tokens, 600]}",
     "summarization.keep: keep tokens>=600 is not below trigger fraction>=0.5 of a 1000-token "
     "window (group 0): the kept tail alone would fire the trigger again for models[0] (small)"),
    # The default keep without a window is the last 20 messages.
    ("summarization: {trigger: [[messages, 15]]}",
     "summarization.keep: keep messages>=20 (the default keep) is not below trigger "
     "messages>=15"),
])
def test_a_keep_that_refires_the_trigger_is_refused_at_load(
        cli_env: dict[str, str], tmp_path: Path, text: str, error: str) -> None:
    out = run(_configured(cli_env, tmp_path, text), "migrate", check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"compactd: {error}"), out.stderr


def test_an_and_group_is_judged_as_and(cli_env: dict[str, str], tmp_path: Path) -> None:
    # The kept 2 messages meet the messages clause but nothing says they hold 1e8 tokens.
    env = _configured(cli_env, tmp_path, "summarization: {trigger: {tokens: 100000000, "
                                         "messages: 2}, keep: [messages, 2]}")
    run(env, "migrate")
    path = tmp_path / "s.jsonl"
    path.write_text(coding_session(steps=3).jsonl())
    run(env, "ingest", str(path), "--session", "s1")
    plan = json.loads(run(env, "plan", "s1", "--json").stdout)
    assert plan["trigger"]["fired"] is False


def test_a_session_window_that_makes_keep_refire_is_refused_at_creation(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    env = _configured(cli_env, tmp_path, "summarization: {trigger: {type: fraction, value: 0.5},"
                                         " keep: [tokens, 600]}")
    run(env, "migrate")
    path = tmp_path / "s.jsonl"
    path.write_text(coding_session(steps=3).jsonl())
    out = run(env, "ingest", str(path), "--session", "s1", "--context-window", "1000",
              check=False)
    assert out.returncode == 2, out.stderr
    assert "compactd: summarization.keep: keep tokens>=600 is not below trigger " \
           "fraction>=0.5 of a 1000-token window" in out.stderr, out.stderr
    assert run(env, "surface", "s1", check=False).returncode == 2  # nothing was created
    run(env, "ingest", str(path), "--session", "s1", "--context-window", "2000")


def test_prune_settings_count_the_marker(cli_env: dict[str, str], tmp_path: Path) -> None:
    env = _configured(cli_env, tmp_path, "summarization: {prune: {threshold_chars: 100, "
                                         "head_chars: 60, tail_chars: 39}}")
    out = run(env, "migrate", check=False)
    assert out.returncode == 2, out.stderr
    assert "summarization.prune: head_chars + tail_chars + the 39-character marker (138) must " \
           "be below threshold_chars (100)" in out.stderr, out.stderr


def test_tail_only_pruning_keeps_the_end_of_a_build_log(cli_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    env = _configured(cli_env, tmp_path, "summarization: {trigger: [[tokens, 50]], "
                                         "keep: [messages, 3], prune: {threshold_chars: 200, "
                                         "head_chars: 0, tail_chars: 30}}")
    log = "".join(f"compiling module {i}\n" for i in range(40)) + "BUILD FAILED: 3 errors"
    call = {"id": "c1", "type": "function", "function": {"name": "make", "arguments": "{}"}}
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in [
        {"role": "user", "content": "build it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": log},
        {"role": "assistant", "content": "The build failed."}]))
    run(env, "migrate")
    run(env, "ingest", str(path), "--session", "s1")
    result = json.loads(run(env, "compact", "s1", "--inline", "--json").stdout)
    assert result["outcome"] == "committed" and result["stages"] == ["prune"], result
    surface = json.loads(run(env, "surface", "s1", "--json").stdout)["messages"]
    pruned = next(m for m in surface if m["role"] == "tool")["content"]
    assert pruned.startswith("\n\n[... tool result middle pruned ...]\n\n"), pruned
    # The marker (39 characters), the last 30, then the note naming the original (seq 3).
    note = '\n[pruned; original: history_read(checkpoint="r3")]'
    assert pruned.endswith(log[-30:] + note) and len(pruned) == 39 + 30 + len(note), pruned


def test_status_says_when_a_fraction_trigger_leaves_a_session_without_compaction(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    # The default trigger is fraction 0.8 alone: a session without a window never compacts.
    path = tmp_path / "s.jsonl"
    path.write_text(coding_session(steps=3).jsonl())
    run(cli_env, "migrate")
    run(cli_env, "ingest", str(path), "--session", "blind")
    run(cli_env, "ingest", str(path), "--session", "known", "--run-model", "gpt-4o")
    text = run(cli_env, "status", "blind").stdout
    assert "WARNING: the run model has no known context window: dropped fraction>=0.8; " \
           "automatic compaction is OFF for this session" in text, text
    body = json.loads(run(cli_env, "status", "blind", "--json").stdout)
    assert body["policy"]["auto"] is False and body["policy"]["trigger"] == []
    known = json.loads(run(cli_env, "status", "known", "--json").stdout)["policy"]
    assert known == {"auto": True, "context_window": 128_000, "trigger": ["fraction>=0.8"],
                     "warnings": []}
    assert "WARNING" not in run(cli_env, "status", "known").stdout
