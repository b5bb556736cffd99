"""A rolling upgrade: a previous release's worker and client run on the schema migrated to this
release's head beside this release's worker and client, and every pairing compacts. Two
releases: the last one before this release's schema (commit c1a9f07, revision 0022, calling the
third generation of the append and the commit) and the last one before versioned functions
(commit bd287a3, revision 0018, calling the unversioned ones). Real Celery worker processes,
PostgreSQL and Redis; the releases' code comes from the repository's history."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import asyncpg
import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.migrate import HEAD_REVISION, upgrade
from tests.support.db import Db
from tests.support.releases import (
    LATEST_RELEASE,
    MODULE_PREFIX_ENV,
    PREVIOUS_RELEASE,
    module_prefix,
    release_tree,
)
from tests.support.services import create_database_sync, drop_database_sync, with_database
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

# A trigger no ingest here reaches: every run is the manual one the test asks for.
POLICY = {"trigger": [{"type": "tokens", "value": 1_000_000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16000}


# The functions this release calls.
CURRENT = {"append": "compactd_append_v5", "claim": "compactd_claim_v2",
           "commit": "compactd_commit_v4"}


@dataclass(frozen=True)
class Release:
    commit: str
    revision: str
    functions: dict[str, str]  # the functions it calls, as CURRENT


RELEASES = [
    Release(LATEST_RELEASE, "0022", {"append": "compactd_append_v3", "claim": "compactd_claim_v2",
                                     "commit": "compactd_commit_v3"}),
    Release(PREVIOUS_RELEASE, "0018", {"append": "compactd_append", "claim": "compactd_claim",
                                       "commit": "compactd_commit"}),
]


@pytest.fixture(scope="session", params=RELEASES, ids=[r.commit for r in RELEASES])
def release(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Release, Path]:
    case: Release = request.param
    return case, release_tree(case.commit, tmp_path_factory.mktemp(f"release-{case.commit}"))


@pytest.fixture
def migrated(pg_url: str) -> Iterator[str]:
    """A database of its own at this release's head, counting calls of its functions."""
    url = with_database(pg_url, f"compactd_mix_{uuid.uuid4().hex[:8]}")
    create_database_sync(url)
    upgrade(url)
    name = urlparse(url).path.lstrip("/")
    _run(url, f"ALTER DATABASE \"{name}\" SET track_functions = 'pl'")
    yield url
    drop_database_sync(url)


def _run(url: str, statement: str) -> object:
    async def run() -> object:
        conn = await asyncpg.connect(urlparse(url)._replace(scheme="postgresql").geturl())
        try:
            return await conn.fetch(statement)
        finally:
            await conn.close()

    return asyncio.run(run())


def _calls(url: str) -> dict[str, int]:
    rows = _run(url, "SELECT funcname, calls FROM pg_stat_user_functions"
                     " WHERE funcname LIKE 'compactd%'")
    return {r["funcname"]: r["calls"] for r in rows}  # type: ignore[attr-defined]


def _counted(url: str, name: str) -> dict[str, int] | None:
    """The call counts once ``name`` has some (the server reports them a little later)."""
    calls = _calls(url)
    return calls if calls.get(name) else None


def _ingest_and_compact(stack: Stack, session: str, env: dict[str, str], seed: int
                        ) -> dict[str, object]:
    path = stack.home / f"{session}.jsonl"
    messages = coding_session(steps=12, big_output_lines=20, seed=seed).messages
    path.write_text("".join(json.dumps(m) + "\n" for m in messages))
    stack.cli("ingest", str(path), "--session", session, "--run-model", "fake-gpt", env=env)
    out = stack.cli("compact", session, "--wait", "--json", env=env)
    result: dict[str, object] = json.loads(out.stdout)
    return result


def _committed_by(stack: Stack, worker: str) -> int:
    return sum(1 for line in stack.log(worker).splitlines()
               if "Task compaction.run[" in line and "succeeded" in line
               and "committed" in line)


def test_previous_and_current_releases_compact_on_the_new_schema(
        migrated: str, clean_redis: str, fake, tmp_path: Path,  # type: ignore[no-untyped-def]
        release: tuple[Release, Path]) -> None:
    case, previous_release = release
    theirs = case.functions
    assert _run(migrated, "SELECT version_num FROM alembic_version")[0][0] == HEAD_REVISION  # type: ignore[index]
    stack = Stack(migrated, clean_redis, tmp_path / "stack", fake_url=fake.url,
                  summarization=POLICY)
    old = {"PYTHONPATH": str(previous_release),
           MODULE_PREFIX_ENV: module_prefix(previous_release)}
    new = {"PYTHONPATH": stack.env["PYTHONPATH"]}
    with stack:
        # The old code is what runs: its own head revision, from the extracted tree.
        # namespace: keep
        probe = (f"import {module_prefix(previous_release)}storage.migrate as m; "
                 "print(m.__file__, m.HEAD_REVISION)")
        head = stack.start("probe", [stack.python, "-c", probe], env=old)
        head.wait(timeout=60)
        assert f"{previous_release}" in stack.log("probe") \
            and f" {case.revision}" in stack.log("probe"), stack.log("probe")

        # 1. The previous release's client and worker, on the migrated schema.
        stack.start_worker("old", concurrency=2, env=old)
        result = _ingest_and_compact(stack, "old-old", old, seed=1)
        assert result["outcome"] == "committed", (result, stack.log("old")[-3000:])
        # A backend reports its function calls when its connection closes, else only after
        # PostgreSQL's idle interval: the worker goes first, its counts at once.
        stack.kill("old")
        calls = wait_until(lambda: _counted(migrated, theirs["commit"]),
                           timeout=30, what="the previous release's commit to be counted")
        assert calls.get(theirs["append"], 0) > 0 and calls.get(theirs["claim"], 0) > 0
        ours_only = set(CURRENT.values()) - set(theirs.values())
        assert not any(calls.get(name) for name in ours_only), calls

        # 2. This release's worker takes the previous release's client's runs.
        stack.start_worker("new", concurrency=2, env=new)
        result = _ingest_and_compact(stack, "old-new", old, seed=2)
        assert result["outcome"] == "committed", (result, stack.log("new")[-3000:])
        assert _committed_by(stack, "new") == 1
        stack.kill("new")
        calls = wait_until(lambda: _counted(migrated, CURRENT["commit"]),
                           timeout=30, what="this release's commit to be counted")
        assert calls.get(CURRENT["claim"], 0) > 0

        # 3. And the previous release's worker takes this release's client's runs.
        stack.start_worker("old2", concurrency=2, env=old)
        before = _calls(migrated).get(theirs["commit"], 0)
        result = _ingest_and_compact(stack, "new-old", new, seed=3)
        assert result["outcome"] == "committed", (result, stack.log("old2")[-3000:])
        assert _committed_by(stack, "old2") == 1
        stack.kill("old2")
        wait_until(lambda: _calls(migrated).get(theirs["commit"], 0) > before, timeout=30,
                   what="the previous release's worker's commit to be counted")
        assert _calls(migrated).get(CURRENT["append"], 0) > 0

    # Every session came out whole: its surface replays from its log.
    with Db(migrated) as db:
        for session in ("old-old", "old-new", "new-old"):
            verified = db.verify(session)
            assert verified.ok, (session, verified.problems)
