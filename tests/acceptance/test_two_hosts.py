"""Workers on two hosts share nothing but PostgreSQL and Redis: two ``celery -A compactd.worker.app
worker`` processes with their own node names and their own ``COMPACTD_HOME`` (config file,
broker-free state), one database and one broker, racing on the same sessions. While they run, a
poller reads the sessions' lease columns and the runs in flight; at no moment may a session have
two live leases, and every session ends compacted."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from compactd.scheduler.client import CompactdClient
from compactd.scheduler.samples import coding_session, iter_steps
from compactd.storage.kinds import JournalKind
from compactd.storage.records import RunRecord, utcnow
from compactd.worker.app import make_app
from compactd.worker.enqueue import Enqueuer, RunRequest
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import Behaviour
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

SESSIONS = 8
POLICY = {"trigger": [{"type": "tokens", "value": 2000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16000}


class LeaseWatch(threading.Thread):
    """Snapshots, as often as it can, of every session's lease and of the runs in flight."""

    def __init__(self, url: str, ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.db = Db(url, pool_size=2)
        self.ids = ids
        self.stop = threading.Event()
        self.snapshots = 0
        self.double: list[tuple[str, list[str]]] = []  # a session with two runs in flight
        self.leases: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                running = self.db.run(lambda s: s.recent_runs(status="running", limit=10_000))
                by_session: dict[str, list[str]] = defaultdict(list)
                for run in running:
                    by_session[run.session_id].append(run.id)
                self.double += [(sid, rids) for sid, rids in by_session.items()
                                if len(rids) > 1]
                now = utcnow()
                for info in self.db.run(lambda s: s.list_sessions(ids=self.ids)):
                    if info.lease_live(now):
                        seen = (info.lease_fence, str(info.lease_run_id), str(info.lease_owner))
                        if not self.leases[info.id] or self.leases[info.id][-1] != seen:
                            self.leases[info.id].append(seen)
                self.snapshots += 1
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc
        finally:
            self.db.close()


def test_two_workers_with_their_own_homes_never_lease_a_session_twice(
        make_stack: Callable[..., Stack], fake, clean_pg: str) -> None:  # type: ignore[no-untyped-def]
    # Every summary takes 0.3 s, so runs of both workers overlap and race for the sessions.
    fake.script(Behaviour(latency_s=0.3, times=-1))
    alpha = make_stack(summarization=POLICY, worker={"lease_s": 30})
    beta = make_stack(summarization=POLICY, worker={"lease_s": 30})
    assert alpha.home != beta.home and alpha.env["COMPACTD_HOME"] != beta.env["COMPACTD_HOME"]
    alpha.start_worker("alpha", concurrency=4)
    beta.start_worker("beta", concurrency=4)
    ids = [f"host-{i}" for i in range(SESSIONS)]
    watch = LeaseWatch(clean_pg, ids)
    watch.start()

    async def drive() -> None:
        # The runtime's path: appends over the trigger signal their sessions, and every
        # session is also sent twice more through each host's broker, so both workers race.
        async with CompactdClient(load_config(env=alpha.env)) as client:
            for n, sid in enumerate(ids):
                session = await client.create_session(sid, run_model="fake-gpt")
                for step in iter_steps(coding_session(steps=16, big_output_lines=20,
                                                      seed=50 + n)):
                    await session.append(step)
    asyncio.run(drive())
    for stack in (alpha, beta):
        app = make_app(load_config(env=stack.env))
        try:
            enqueuer = Enqueuer(app)
            for sid in ids:
                enqueuer.send(RunRequest(sid, "sweep"))
                enqueuer.send(RunRequest(sid, "pressure"))
        finally:
            app.close()

    with Db(clean_pg) as db:
        def settled() -> list[RunRecord] | None:
            runs = db.run(lambda s: s.recent_runs(limit=10_000))
            done = {r.session_id for r in runs if r.status == "committed"}
            busy = [r for r in runs if r.status == "running"]
            return runs if done >= set(ids) and not busy and len(runs) >= 5 * SESSIONS \
                else None

        runs = wait_until(settled, timeout=120, interval=0.5,
                          what="every session compacted and every sent run ended")
        watch.stop.set()
        watch.join(30)
        assert watch.error is None, watch.error
        assert watch.snapshots > 20
        assert not watch.double, f"sessions with two runs in flight at once: {watch.double}"
        # Every lease the poller saw belongs to a run of that session, and a session's fences
        # only ever grew: no two claims held it with the same or an older fence. The runs are
        # read again once the poller has stopped: a late duplicate can claim (and find nothing
        # to do) between the settled read and the poller's last snapshot.
        runs = db.run(lambda s: s.recent_runs(limit=10_000))
        by_id = {r.id: r for r in runs}
        for sid, seen in watch.leases.items():
            assert all(by_id[run_id].session_id == sid for _, run_id, _ in seen), sid
            fences = [fence for fence, _, _ in seen]
            assert fences == sorted(set(fences)), (sid, seen)
        assert sum(len(seen) for seen in watch.leases.values()) > 0
        # From each session's log (gapless seqs, one order for both hosts): every claim's
        # compaction/start is closed by its own compaction/end before the next claim starts.
        for sid in ids:
            holder: str | None = None
            for event in db.events(sid, kinds=[JournalKind.START, JournalKind.END]):
                if event.kind == JournalKind.START:
                    assert holder is None, (sid, holder, event.run_id)
                    holder = event.run_id
                else:
                    assert event.run_id == holder, (sid, holder, event.run_id)
                    holder = None
            assert holder is None, sid
        # Both hosts did the work, and every session ended compacted and consistent.
        owners = {r.owner for r in runs if r.status == "committed"}
        assert len(owners) == 2, owners
        assert all(db.verify(sid).ok for sid in ids)
    assert "alpha@" in alpha.log("alpha") and "beta@" in beta.log("beta")
    assert Path(alpha.env["COMPACTD_CONFIG"]).parent == alpha.home
