"""Bulk recompaction: ``compactd recompact``.

A job is a filter and the sessions it matched, one item per session (pending -> enqueued -> done,
skipped or failed). The fan-out enqueues on ``compaction.bulk`` in chunks, paced at the job's
rate, and waits, showing its progress on stderr (a bar on a terminal, else a line of text per
change; JSON lines with ``--json``). Workers honour the same rate per model call on a meter in
Redis shared by all of them, so neither a provider quota nor the urgent queue suffers.

Without ``--force`` a session compacts only when it is over its trigger; one under it ends
``skipped`` (nothing to do), not ``done``. ``--force`` ignores the trigger and keeps the tail
the session's keep policy names, as a manual ``compact`` without ``--force`` does: a job
re-applies the policy to many sessions, it never cuts them all to their last turn.

Resumable and idempotent: ``--resume JOB`` enqueues every item not yet done again. An item is
marked done in the same transaction that ends its run, and a claim for an item already done is
skipped under the session's row lock, so a session is compacted once however often its item is
delivered.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compactd.scheduler.args import parse_duration
from compactd.scheduler.client import WaitTimeout
from compactd.scheduler.output import emit, open_store, say
from compactd.storage.errors import InvalidMessage
from compactd.storage.ids import id_problem
from compactd.storage.kinds import ItemState, JobState, RunCause
from compactd.storage.records import BulkJob, utcnow
from compactd.storage.store import Store
from compactd.worker.app import client_app
from compactd.worker.enqueue import Enqueuer, RunRequest
from compactd.worker.keys import QUEUE_BULK, bulk_meter
from compactd.worker.limits import LocalLimiter
from compactd.worker.settings import Config

PROGRESS_EVERY_S = 0.5
# Session ids a dry run prints (``--json`` lists them all).
DRY_RUN_SHOWN = 20
# How long ``recompact`` waits without any item of its job ending before it gives up waiting.
WAIT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class BulkFilter:
    tenant: str | None = None
    run_model: str | None = None
    min_tokens: int | None = None
    idle_for_s: float | None = None
    session_file: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> BulkFilter:
        if args.min_tokens is not None and args.min_tokens < 0:
            raise InvalidMessage("must be non-negative", field="min-tokens")
        return cls(tenant=args.tenant, run_model=args.run_model, min_tokens=args.min_tokens,
                   idle_for_s=parse_duration(args.idle_for) if args.idle_for else None,
                   session_file=args.session_file)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _session_ids(raw: bytes) -> list[str]:
    """The ids of a session file, one a line, each checked as every door checks an id."""
    ids = []
    for number, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise InvalidMessage(f"not valid UTF-8 (byte {exc.start})", field="session-file",
                                 line=number) from None
        if text:
            problem = id_problem(text)
            if problem is not None:
                raise InvalidMessage(problem, field="session-file", line=number)
            ids.append(text)
    return ids


async def matching_sessions(store: Store, bulk_filter: BulkFilter) -> list[str]:
    ids: list[str] | None = None
    if bulk_filter.session_file:
        try:
            raw = await asyncio.to_thread(Path(bulk_filter.session_file).read_bytes)
        except OSError as exc:
            raise InvalidMessage(f"cannot read {bulk_filter.session_file}: {exc.strerror}",
                                 field="session-file") from None
        ids = sorted(set(_session_ids(raw)))
    idle_before = None
    if bulk_filter.idle_for_s is not None:
        idle_before = utcnow() - dt.timedelta(seconds=bulk_filter.idle_for_s)
    out: list[str] = []
    after: str | None = None
    while True:
        page = await store.list_sessions(
            tenant=bulk_filter.tenant, run_model=bulk_filter.run_model,
            min_tokens=bulk_filter.min_tokens, idle_before=idle_before, after_id=after,
            ids=ids, limit=1000)
        out.extend(s.id for s in page)
        if len(page) < 1000:
            return out
        after = page[-1].id


async def run_recompact(config: Config, bulk_filter: BulkFilter, *, force: bool, dry_run: bool,
                        rate_per_s: float | None, resume: str | None, as_json: bool,
                        chunk: int = 100, wait: bool = True,
                        enqueuer: Enqueuer | None = None,
                        timeout_s: float | None = None) -> int:
    if chunk <= 0:
        raise InvalidMessage("must be positive", field="chunk")
    timeout_s = WAIT_TIMEOUT_S if timeout_s is None else timeout_s
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidMessage(f"must be a positive number of seconds, got {timeout_s!r}",
                             field="timeout")
    async with open_store(config) as store:
        if resume:
            job = await store.get_bulk_job(resume)
            if job is None:
                raise InvalidMessage(f"no bulk job {resume!r}", field="resume")
            rate_per_s = rate_per_s or job.rate_per_s
            force = job.force
        else:
            ids = await matching_sessions(store, bulk_filter)
            if dry_run:
                _say_dry_run(ids, bulk_filter, force=force, as_json=as_json)
                return 0
            job = await store.create_bulk_job(filter=bulk_filter.to_json(), session_ids=ids,
                                              force=force, rate_per_s=rate_per_s)
        enqueuer = enqueuer or Enqueuer(client_app(config))
        progress = Progress(job, as_json=as_json)
        states = ([ItemState.PENDING] if not resume
                  else [ItemState.PENDING, ItemState.ENQUEUED, ItemState.FAILED])
        await fan_out(store, enqueuer, job, states=states, force=force, rate_per_s=rate_per_s,
                      chunk=chunk, progress=progress)
        if wait:
            job = await wait_for_job(store, job.id, progress, timeout_s=timeout_s)
            await store.set_bulk_job_state(job.id, JobState.DONE)
            job = await store.get_bulk_job(job.id) or job
        progress.close()
    if as_json:
        emit({"job": job.to_json()})
    else:
        say(f"bulk job {job.id}: {job.matched} matched, {job.done} compacted, {job.skipped} "
            f"skipped (nothing to do{'' if force else ': under their trigger'}), "
            f"{job.failed} failed"
            + ("" if wait else " (still running: compactd status shows its progress)"))
    return 1 if job.failed else 0


def _say_dry_run(ids: Sequence[str], bulk_filter: BulkFilter, *, force: bool,
                 as_json: bool) -> None:
    if as_json:
        emit({"dry_run": True, "matched": len(ids), "filter": bulk_filter.to_json(),
              "force": force, "sessions": list(ids)})
        return
    say(f"{len(ids)} sessions match; nothing enqueued (dry run)")
    for sid in ids[:DRY_RUN_SHOWN]:
        say(f"  {sid}")
    if len(ids) > DRY_RUN_SHOWN:
        say(f"  ... and {len(ids) - DRY_RUN_SHOWN} more (--json lists them all)")
    if not force:
        say("without --force, a session under its trigger will be skipped (nothing to do)")


async def fan_out(store: Store, enqueuer: Enqueuer, job: BulkJob, *, states: Sequence[str],
                  force: bool, rate_per_s: float | None, chunk: int,
                  progress: Progress | None = None) -> int:
    """Enqueue the job's items in ``states``, ``chunk`` at a time, paced at the job's rate."""
    pacer = LocalLimiter()
    sent = 0
    after: str | None = None
    while True:
        ids = await store.bulk_items(job.id, states=states, limit=chunk, after_session=after)
        if not ids:
            return sent
        # Marked before they are sent: a worker that ends an item (done or failed) always writes
        # after this, so its ending is never overwritten. A fan-out that dies mid-chunk leaves
        # items enqueued but unsent, and ``--resume`` sends enqueued items again.
        await store.mark_bulk_items(job.id, ids, ItemState.ENQUEUED, from_states=states)
        for sid in ids:
            if rate_per_s:
                await pacer.acquire(bulk_meter(job.id), rate_per_s)
            await enqueuer.asend(RunRequest(sid, RunCause.BULK, force=force, bulk_job_id=job.id,
                                            rate_per_s=rate_per_s))
        sent += len(ids)
        after = ids[-1]
        if progress is not None:
            await progress.update(store)


async def wait_for_job(store: Store, job_id: str, progress: Progress, *,
                       timeout_s: float = WAIT_TIMEOUT_S) -> BulkJob:
    """Wait until every item has ended; raise :class:`WaitTimeout` when none ended for
    ``timeout_s`` (a job of many sessions at a low rate takes long but keeps moving, while a
    job no worker consumes never does)."""
    loop = asyncio.get_running_loop()
    ended, deadline = -1, 0.0
    while True:
        job = await store.get_bulk_job(job_id)
        assert job is not None
        progress.show(job)
        if job.ended >= job.matched:
            return job
        if job.ended > ended:
            ended, deadline = job.ended, loop.time() + timeout_s
        elif loop.time() >= deadline:
            raise WaitTimeout(
                f"bulk job {job_id}: no session finished within {timeout_s:g} s ({job.done} "
                f"compacted, {job.skipped} skipped, {job.failed} failed, "
                f"{job.matched - job.ended} not yet); is "
                f"a worker consuming {QUEUE_BULK}? The job stays: `compactd status` shows it, "
                f"`compactd recompact --resume {job_id}` sends what is not done again")
        await asyncio.sleep(PROGRESS_EVERY_S)


class Progress:
    """On stderr: JSON lines with ``--json``, else a bar on a terminal and a line of text per
    change elsewhere (a log, a pipe)."""

    def __init__(self, job: BulkJob, *, as_json: bool) -> None:
        self.job_id = job.id
        self.as_json = as_json
        self.tty = sys.stderr.isatty() and not as_json
        self._last = ""

    async def update(self, store: Store) -> None:
        job = await store.get_bulk_job(self.job_id)
        if job is not None:
            self.show(job)

    def show(self, job: BulkJob) -> None:
        counts = (f"{job.ended}/{job.matched} ended: {job.done} compacted, {job.skipped} "
                  f"skipped, {job.failed} failed; {job.enqueued} enqueued")
        if self.as_json:
            line = json.dumps({"job": job.id, "matched": job.matched, "enqueued": job.enqueued,
                               "done": job.done, "skipped": job.skipped,
                               "failed": job.failed}) + "\n"
        elif self.tty:
            width = 30
            filled = int(width * job.ended / job.matched) if job.matched else width
            line = f"\r[{'#' * filled}{'.' * (width - filled)}] {counts}"
        else:
            line = f"bulk job {job.id}: {counts}\n"
        if line != self._last:
            sys.stderr.write(line)
            sys.stderr.flush()
            self._last = line

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")

