"""Downgrades land on a schema the release at that revision runs, or are refused before any
step: a populated database goes head -> 0015 (where the code of 0015's release appends, claims
and commits, its functions restored) -> base -> head (where this code does), on PostgreSQL and
on SQLite; a downgrade past 0014 to anything but base is refused and changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.util import CommandError

from compactd.storage.database import create_engine
from compactd.storage.migrate import HEAD_REVISION, alembic_config, upgrade
from tests.support.releases import RELEASE_AT, module_prefix, release_tree
from tests.support.services import create_database_sync, drop_database_sync, with_database

REPO = Path(__file__).resolve().parents[2]
LANDING = "0015"

# What a release does with a store: the session populated before the downgrade takes another
# message, and a new session is appended to, claimed and committed (a checkpoint over its first
# two messages, the run ended), then replayed. The store API it calls is the same in the
# releases compared here. Prints the result as JSON.
USE_STORE = r"""
import asyncio, json, sys
from PKGstorage.messages import Message
from PKGstorage.records import Claim, Replacement, RunEnd
from PKGstorage.store import Store
import PKGstorage.migrate

async def main(url, session):
    store = Store.from_url(url)
    try:
        await store.append("populated", [Message(role="user", content="after the walk")])
        await store.create_session(session)
        appended = await store.append(
            session, [Message(role="user", content=f"message {i} " + "word " * 40)
                      for i in range(4)])
        claim = await store.claim(session, owner="release", trigger="manual", lease_s=30)
        assert isinstance(claim, Claim), claim
        first = appended.last_seq - 3
        checkpoint = Replacement(
            seqs=(first, first + 1), kind="checkpoint", tokens=5,
            payload={"role": "user", "content": "summary",
                     "meta": {"checkpoint": True, "summary": "summary"}},
            journal_kind="compaction/summary", journal={"text": "summary"})
        info = await store.commit(session, run_id=claim.run_id, fence=claim.fence,
                                  replacements=[checkpoint], end=RunEnd(outcome="committed"))
        verified = [(await store.verify(s)).ok for s in ("populated", session)]
        print(json.dumps({"code": PKGstorage.migrate.__file__,
                          "head": PKGstorage.migrate.HEAD_REVISION, "messages":
                          info.surface_messages, "verified": verified}))
    finally:
        await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'walk.sqlite3'}"
        return
    pg = with_database(request.getfixturevalue("pg_url"), f"compactd_walk_{uuid.uuid4().hex[:8]}")
    create_database_sync(pg)
    yield pg
    drop_database_sync(pg)


@pytest.fixture(scope="session")
def landing_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    commit = RELEASE_AT[LANDING]
    return release_tree(commit, tmp_path_factory.mktemp(f"release-{commit}"))


def _use_store(url: str, session: str, tree: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
    env["PYTHONPATH"] = str(tree)
    # Run from the tree: ``python -c`` puts its working directory first on the import path.
    script = USE_STORE.replace("PKGstorage", module_prefix(tree) + "storage")
    out = subprocess.run([sys.executable, "-c", script, url, session], env=env, cwd=tree,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the code of {tree} on the schema failed:\n{out.stderr}"
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(str(result.pop("code"))).is_relative_to(tree), result
    return result


async def _populate(url: str) -> None:
    """A session with messages, a committed checkpoint (recall rows) and a run."""
    from compactd.storage.messages import Message
    from compactd.storage.records import Claim, Replacement, RunEnd
    from compactd.storage.store import Store

    store = Store.from_url(url)
    try:
        await store.create_session("populated")
        appended = await store.append("populated", [
            Message(role="user", content=f"populated {i} " + "text " * 50) for i in range(6)])
        claim = await store.claim("populated", owner="head", trigger="manual", lease_s=30)
        assert isinstance(claim, Claim)
        first = appended.first_seq
        await store.commit("populated", run_id=claim.run_id, fence=claim.fence, replacements=[
            Replacement(seqs=(first, first + 1, first + 2), kind="checkpoint", tokens=5,
                        payload={"role": "user", "content": "summary",
                                 "meta": {"checkpoint": True, "summary": "summary"}},
                        journal_kind="compaction/summary", journal={"text": "summary"})],
            end=RunEnd(outcome="committed"))
        await store.index_recall()
    finally:
        await store.close()


async def _state(url: str) -> tuple[str | None, int, list[str]]:
    """The revision, the number of events, and compactd's functions (PostgreSQL)."""
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            names = set(await conn.run_sync(lambda c: sa.inspect(c).get_table_names()))
            revision = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))
                        ).scalar() if "alembic_version" in names else None
            events = (await conn.execute(sa.text("SELECT count(*) FROM events"))).scalar() \
                if "events" in names else 0
            functions: list[str] = []
            if conn.dialect.name == "postgresql":
                functions = sorted((await conn.execute(sa.text(
                    "SELECT proname FROM pg_proc WHERE proname LIKE 'compactd%'"))).scalars())
    finally:
        await engine.dispose()
    return revision, int(events or 0), functions


def test_a_populated_database_walks_head_base_head(url: str, landing_release: Path) -> None:
    postgres = url.startswith("postgresql")
    config = alembic_config(url)
    upgrade(url)
    asyncio.run(_populate(url))
    revision, events, _ = asyncio.run(_state(url))
    assert revision == HEAD_REVISION and events > 0

    # Past 0014 (to anything but base) is refused before any step: nothing changes.
    for destination in ("0013", "0004"):
        with pytest.raises(CommandError, match=r"0014 .*cannot be undone.*Nothing was changed"):
            command.downgrade(config, destination)
        assert asyncio.run(_state(url))[:2] == (HEAD_REVISION, events)

    # Down to 0015: that release's code appends, claims and commits, and reads what the head
    # wrote.
    command.downgrade(config, LANDING)
    assert asyncio.run(_state(url))[0] == LANDING
    used = _use_store(url, "at-0015", landing_release)
    assert used == {"head": LANDING, "messages": 3, "verified": [True, True]}, used

    # Base leaves nothing behind, and head is reached again; this code then runs on it.
    command.downgrade(config, "base")
    assert asyncio.run(_state(url)) == (None, 0, [])
    upgrade(url)
    assert asyncio.run(_state(url))[0] == HEAD_REVISION
    asyncio.run(_populate(url))
    used = _use_store(url, "at-head", REPO)
    assert used == {"head": HEAD_REVISION, "messages": 3, "verified": [True, True]}, used
    if postgres:
        from compactd.storage.sql import FUNCTIONS, PREVIOUS_RELEASE_FUNCTIONS

        assert asyncio.run(_state(url))[2] == sorted(FUNCTIONS + PREVIOUS_RELEASE_FUNCTIONS)
