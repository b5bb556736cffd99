"""``compactd history search|read`` and ``compactd tools`` as the real CLI in a subprocess, on
the embedded SQLite and on PostgreSQL: a session ingested and compacted inline by the CLI, a
dropped fact found and read back, and bad input refused (exit 2, one line naming the argument)
with nothing written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from compactd.storage.store import Store
from compactd.worker.compaction.recall_tools import tools_document
from tests.conftest import run_cli as run
from tests.support.recall_sample import NEEDLE, needle_messages
from tests.support.tables import row_counts


@pytest.fixture(scope="module")
def env(module_cli_env: dict[str, str]) -> dict[str, str]:
    """The needle session ingested and compacted inline, once per module and kind: the tests
    below only read it (the one that tries bad input checks that nothing was written)."""
    home = Path(module_cli_env["COMPACTD_HOME"])
    config = home / "compactd.yaml"
    config.write_text("summarization:\n  trigger: [{type: tokens, value: 20000}]\n"
                      "  keep: {type: messages, value: 12}\n")
    module_cli_env["COMPACTD_CONFIG"] = str(config)
    path = home / "s.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in needle_messages()))
    run(module_cli_env, "migrate")
    run(module_cli_env, "ingest", str(path), "--session", "s1")
    compacted = json.loads(run(module_cli_env, "compact", "s1", "--inline", "--json").stdout)
    assert compacted["outcome"] == "committed", compacted
    return module_cli_env


def _rows(env: dict[str, str]) -> dict[str, int]:
    async def count() -> dict[str, int]:
        store = Store.from_url(env["TEST_DATABASE_URL"])
        try:
            return await row_counts(store)
        finally:
            await store.close()

    return asyncio.run(count())


def test_search_finds_the_dropped_fact_and_read_pages_it_back(env: dict[str, str]) -> None:
    assert NEEDLE not in run(env, "surface", "s1", "--json").stdout
    found = json.loads(run(env, "history", "search", "s1", NEEDLE, "--json").stdout)
    top = found["hits"][0]
    assert top["exact"] and NEEDLE in top["snippet"] and found["scanned"]["messages"] > 0
    text = run(env, "history", "search", "s1", NEEDLE, "--limit", "1").stdout
    assert text.startswith(f"{top['checkpoint']}  seq {top['seq']}  exact")
    assert "1 hit(s); scanned" in text
    # Pages of 8,000 tokens: the cursor is followed through several pages (21 at the default
    # 2,000, each a process), and the default page is read below.
    read = ["history", "read", "s1", top["checkpoint"], "--budget-tokens", "8000", "--json"]
    transcript, pages, args = "", 0, read
    while pages < 50:
        pages += 1
        page = json.loads(run(env, *args).stdout)
        transcript += page["transcript"]
        if page["cursor"] is None:
            break
        args = [*read, "--cursor", page["cursor"]]
    assert NEEDLE in transcript and page["cursor"] is None and pages > 2, pages
    plain = run(env, "history", "read", "s1", top["checkpoint"]).stdout
    assert plain.startswith("[seq ") and "-- more: compactd history read s1" in plain


def test_budget_tokens_bounds_the_page_and_the_next_command_keeps_it(
        env: dict[str, str]) -> None:
    ref = json.loads(run(env, "history", "search", "s1", NEEDLE, "--json").stdout
                     )["hits"][0]["checkpoint"]
    small = json.loads(run(env, "history", "read", "s1", ref, "--budget-tokens", "64",
                           "--json").stdout)
    default = json.loads(run(env, "history", "read", "s1", ref, "--json").stdout)
    assert small["tokens"] <= 64 < default["tokens"] and small["cursor"] is not None
    plain = run(env, "history", "read", "s1", ref, "--budget-tokens", "64").stdout
    assert plain.rstrip().endswith(f"--cursor {small['cursor']} --budget-tokens 64")


# Refused by their arguments alone, whatever the database holds.
BAD_SEARCHES = [
    (["history", "search", "s1", ""], "QUERY: is empty"),
    (["history", "search", "s1", "x" * 10_240], "QUERY: is 10240 bytes"),
    (["history", "search", "s1", "x", "--limit", "101"], "--limit"),
    (["history", "search", "s1", "x", "--limit", "0"], "--limit"),
    (["history", "search", "s1", "x", "--checkpoint", "nope"], "--checkpoint"),
    # subprocess encodes the lone surrogate back to the byte 0xFF: a query that is not UTF-8
    (["history", "search", "s1", "disk \udcff full"], "QUERY: is not valid UTF-8"),
]


def assert_refused(env: dict[str, str], args: list[str], named: str) -> None:
    """Exit 2, one line on stderr naming what is wrong, nothing on stdout."""
    out = run(env, *args, check=False)
    assert out.returncode == 2, (args, out.returncode, out.stderr)
    assert out.stdout == "" and "Traceback" not in out.stderr, (args, out.stderr)
    assert named in out.stderr, (args, out.stderr)


def test_bad_input_on_a_home_without_a_database_creates_no_file(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    home = tmp_path / "fresh"
    home.mkdir()
    env = {**cli_env, "COMPACTD_HOME": str(home)}
    cases = [
        *BAD_SEARCHES,
        (["history", "read", "s1", "c1-2", "--offset", "-1"], "--offset"),
        (["history", "read", "s1", "c1-2", "--cursor", "x" * 300], "--cursor"),
        (["history", "read", "s1", "c1-2", "--budget-tokens", "10"], "--budget-tokens"),
        (["history", "read", "s1", "c-2"], "CHECKPOINT"),
        # well-formed, but there is no database, so no session: still nothing created
        (["history", "search", "s1", "x"], "session 's1' does not exist"),
        (["history", "read", "s1", "c1-2"], "session 's1' does not exist"),
    ]
    for args, named in cases:
        assert_refused(env, args, named)
        assert list(home.iterdir()) == [], (args, list(home.iterdir()))


def test_tools_json_prints_both_forms(env: dict[str, str]) -> None:
    assert json.loads(run(env, "tools", "--json").stdout) == tools_document()
    assert run(env, "tools").stdout.startswith("history_search: ")


def test_bad_input_exits_2_naming_the_argument_and_writes_nothing(env: dict[str, str]) -> None:
    ref = json.loads(run(env, "history", "search", "s1", NEEDLE, "--json").stdout
                     )["hits"][0]["checkpoint"]
    cursor = json.loads(run(env, "history", "read", "s1", ref, "--json").stdout)["cursor"]
    assert cursor is not None
    before = _rows(env)
    cases = [
        *BAD_SEARCHES,
        (["history", "search", "s1", "x", "--checkpoint", "r424242"], "r424242"),
        (["history", "search", "no-such-session", "x"], "no-such-session"),
        (["history", "read", "s1", "c999999-1000000"], "c999999-1000000"),
        (["history", "read", "s1", ref, "--offset", "-1"], "--offset"),
        (["history", "read", "s1", ref, "--cursor", "garbage"], "--cursor"),
        (["history", "read", "s1", "r1", "--cursor", cursor], "--cursor"),
        (["history", "read", "s1", ref, "--offset", "1", "--cursor", cursor], "--cursor"),
        (["history", "read", "s1", ref, "--budget-tokens", "63"], "--budget-tokens"),
        (["history", "read", "s1", ref, "--budget-tokens", "100001"], "--budget-tokens"),
        (["history", "read", "s1", ref, "--budget-tokens", "many"], "--budget-tokens"),
        (["history", "read", "s1", ref, "--cursor", ""], "--cursor: is empty"),
    ]
    for args, named in cases:
        assert_refused(env, args, named)
    assert _rows(env) == before


def test_the_embedded_default_folds_unicode_case_and_finds_text_after_a_nul(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    """SQLite's own lower() folds ASCII only and its JSON reader ends a text at a NUL: neither
    may hide a replaced message from a search on the embedded default."""
    config = tmp_path / "compactd.yaml"
    config.write_text("summarization:\n  trigger: [{type: tokens, value: 500}]\n"
                      "  keep: {type: messages, value: 2}\n")
    cli_env["COMPACTD_CONFIG"] = str(config)
    messages = [{"role": "user", "content": "Read the archive header."},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "read", "arguments": '{"path": "a.bin"}'}}]},
                {"role": "tool", "tool_call_id": "c1",
                 "content": "MAGIC\x00\x00 trailer: zanzibar-7731 checksum ok"},
                {"role": "assistant", "content": "Die Übergröße des Archivs ist das Problem."},
                *({"role": "user" if i % 2 else "assistant", "content": f"step {i} " * 40}
                  for i in range(12)),
                {"role": "user", "content": "What next?"}]
    path = tmp_path / "nul.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in messages))
    run(cli_env, "migrate")
    run(cli_env, "ingest", str(path), "--session", "s1")
    compacted = json.loads(run(cli_env, "compact", "s1", "--inline", "--json").stdout)
    assert compacted["outcome"] == "committed" and 3 in compacted["replaced_seqs"], compacted
    found = json.loads(run(cli_env, "history", "search", "s1", "zanzibar-7731", "--json").stdout)
    assert [(h["seq"], h["exact"]) for h in found["hits"]] == [(3, True)], found
    assert "zanzibar-7731 checksum" in found["hits"][0]["snippet"]
    words = json.loads(run(cli_env, "history", "search", "s1", "checksum trailer",
                           "--json").stdout)
    assert [h["seq"] for h in words["hits"]] == [3], words
    for query in ("übergröße", "ÜBERGRÖßE DES"):
        folded = json.loads(run(cli_env, "history", "search", "s1", query, "--json").stdout)
        assert [(h["seq"], h["exact"]) for h in folded["hits"]] == [(4, True)], (query, folded)
    # the original reads back whole, NULs included
    page = json.loads(run(cli_env, "history", "read", "s1", found["hits"][0]["checkpoint"],
                          "--budget-tokens", "100000", "--json").stdout)
    assert "MAGIC\x00\x00 trailer: zanzibar-7731" in page["transcript"]
