"""Helpers the benchmark scripts share: databases of their own, statistics, the machine line.

Not a benchmark itself. Every script that touches PostgreSQL or Redis uses a database of its own
(``compactd_bench_<script>``, created and migrated when absent, emptied at the start of a run) so
two benchmarks, or a benchmark and the test suite, never share rows.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tests.support.services import reset_database

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpus"
PG_BASE = os.environ.get("COMPACTD_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("COMPACTD_BENCH_REDIS_URL", "redis://127.0.0.1:6379/9")
def pg_url(script: str) -> str:
    """The script's own database: ``COMPACTD_BENCH_DATABASE_URL`` (a server URL, or a full URL
    whose database name is replaced) with the database ``compactd_bench_<script>``."""
    parsed = urlparse(PG_BASE)
    return parsed._replace(path=f"/compactd_bench_{script}").geturl()


def prepare_pg(url: str) -> str:
    """Create (if absent), migrate and empty the database at ``url``."""
    asyncio.run(reset_database(url))
    return url


async def analyze(url: str) -> None:
    """Refresh the planner's statistics after a bulk fill (autovacuum would, given time)."""
    import asyncpg

    conn = await asyncpg.connect(urlparse(url)._replace(scheme="postgresql").geturl())
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def _calibrate(url: str, samples: int) -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(urlparse(url)._replace(scheme="postgresql").geturl())
    try:
        settings = dict(await conn.fetch(
            "SELECT name, setting FROM pg_settings WHERE name = ANY($1::text[])",
            ["synchronous_commit", "fsync", "wal_sync_method", "shared_buffers"]))
        version = await conn.fetchval("SHOW server_version")
        await conn.execute("CREATE TABLE IF NOT EXISTS bench_calibration (id serial PRIMARY KEY, "
                           "body text)")
        trips: list[float] = []
        commits: list[float] = []
        for _ in range(samples):
            started = time.perf_counter()
            await conn.fetchval("SELECT 1")
            trips.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            await conn.execute("INSERT INTO bench_calibration (body) VALUES ($1)", "x" * 200)
            commits.append((time.perf_counter() - started) * 1000)
        await conn.execute("DROP TABLE bench_calibration")
    finally:
        await conn.close()
    return {"server_version": version, "settings": settings,
            "select1_ms": round(statistics.median(trips), 3),
            "insert_commit_ms": round(statistics.median(commits), 3),
            "insert_commit_p99_ms": round(percentile(commits, 99), 3)}


def calibrate_pg(url: str, samples: int = 100) -> dict[str, Any]:
    """The floor under any write: a ``SELECT 1`` round trip and a one-row INSERT's commit
    (WAL flush included), measured now. On a machine whose disk is busy with other work the
    commit floor alone can exceed a millisecond; the README should quote it with the results."""
    return asyncio.run(_calibrate(url, samples))


class CommitProbe:
    """Samples the PostgreSQL commit floor while a benchmark runs: one-row INSERT commits on a
    connection of its own, taken between (never inside) the timed operations."""

    def __init__(self, url: str) -> None:
        self.url = urlparse(url)._replace(scheme="postgresql").geturl()
        self.conn: Any = None
        self.samples: list[float] = []

    async def open(self) -> None:
        import asyncpg

        self.conn = await asyncpg.connect(self.url)
        await self.conn.execute("CREATE TABLE IF NOT EXISTS bench_probe (id serial PRIMARY KEY, "
                                "body text)")

    async def sample(self) -> None:
        started = time.perf_counter()
        await self.conn.execute("INSERT INTO bench_probe (body) VALUES ($1)", "x" * 200)
        self.samples.append((time.perf_counter() - started) * 1000)

    async def idle_floor(self, idle_s: float, samples: int) -> list[float]:
        """What the least a step can cost after ``idle_s`` of idleness: a one-row INSERT's commit
        then a primary-key read, after sleeping as the agent does between steps. On a VM whose
        idle vCPUs halt (no halt polling), waking costs more than the round trips themselves:
        an append-and-poll step cannot beat this, while the warm floor of :meth:`sample`
        underrates it."""
        floor: list[float] = []
        for _ in range(samples):
            await asyncio.sleep(idle_s)
            started = time.perf_counter()
            row_id = await self.conn.fetchval(
                "INSERT INTO bench_probe (body) VALUES ($1) RETURNING id", "x" * 200)
            await self.conn.fetchval("SELECT body FROM bench_probe WHERE id = $1", row_id)
            floor.append((time.perf_counter() - started) * 1000)
        return floor

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.execute("DROP TABLE IF EXISTS bench_probe")
            await self.conn.close()


def prepare_sqlite(directory: Path) -> str:
    from compactd.storage.migrate import upgrade

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "compactd.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    url = f"sqlite:///{path}"
    upgrade(url)
    return url


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): p99 of 300 samples is the 297th smallest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max / mean of millisecond samples, rounded for the report."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_ms": round(statistics.median(values), 3),
            "p90_ms": round(percentile(values, 90), 3),
            "p99_ms": round(percentile(values, 99), 3), "max_ms": round(max(values), 3),
            "mean_ms": round(statistics.fmean(values), 3)}


def machine() -> dict[str, Any]:
    """What the numbers were measured on (the README quotes it)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gb = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": mem_gb,
            "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}",
            "load_avg_at_start": [round(x, 2) for x in load] if load else None,
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}


def machine_line(info: dict[str, Any]) -> str:
    load = info.get("load_avg_at_start")
    return (f"{info['cpu']}, {info['cores']} cores, {info['memory_gb']} GB, Python "
            f"{info['python']}, {info['os']}" + (f", load {load[0]} at start" if load else ""))


def write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers], *[[_cell(v) for v in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
