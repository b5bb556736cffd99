"""Prometheus metrics of the workers.

The worker runs the threads pool: one process, so one registry and one HTTP endpoint per worker
(``worker.metrics_port``, default 9540, 0 = off), started when the worker boots. Task threads
(queue wait) and the process's event loop thread (everything else) update the same metrics;
prometheus-client's metrics are thread-safe, and :func:`metrics` creates them once under a lock.
Under a prefork pool each child would count into its own registry, unseen by the endpoint in the
parent, so the worker refuses to serve metrics there (``worker.tasks``) rather than serve zeros.

Label sets are bounded: outcome, failure class, trigger, candidate (a configured model name),
error kind. Compactions per session are a histogram, not a per-session label (unbounded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

TOKEN_BUCKETS = (500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000, 256_000,
                 512_000, 1_000_000)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 240)


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.compactions = Counter(
            "compactd_compactions", "Compaction runs by outcome and failure class.",
            ["outcome", "failure_class", "trigger"], registry=registry)
        self.tokens_before = Histogram(
            "compactd_tokens_before", "Session pressure (tokens) when a run started.",
            buckets=TOKEN_BUCKETS, registry=registry)
        self.tokens_after = Histogram(
            "compactd_tokens_after", "Session pressure (tokens) after a committed run.",
            buckets=TOKEN_BUCKETS, registry=registry)
        self.tokens_saved = Counter(
            "compactd_tokens_saved", "Tokens removed from surfaces by committed runs.",
            ["stage"], registry=registry)
        self.prune_only = Counter(
            "compactd_prune_only_runs", "Runs that pruned and needed no model call.",
            registry=registry)
        self.model_latency = Histogram(
            "compactd_model_latency_seconds", "Summary model calls by candidate.",
            ["candidate"], buckets=LATENCY_BUCKETS, registry=registry)
        self.model_failures = Counter(
            "compactd_model_failures", "Failed summary candidates by error kind.",
            ["candidate", "kind"], registry=registry)
        self.fallback_depth = Histogram(
            "compactd_fallback_depth",
            "Position of the candidate that wrote the summary (0 = the first).",
            buckets=(0, 1, 2, 3, 4, 6), registry=registry)
        self.queue_wait = Histogram(
            "compactd_queue_wait_seconds", "Time from enqueue to the worker starting the run.",
            ["queue"], buckets=LATENCY_BUCKETS, registry=registry)
        self.lease_reaps = Counter(
            "compactd_lease_reaps", "Expired leases closed by the reaper (runs abandoned).",
            registry=registry)
        self.loop_guard_flags = Counter(
            "compactd_loop_guard_flags", "Sessions flagged and cooled down by the loop guard.",
            registry=registry)
        self.flagged_sessions = Gauge(
            "compactd_flagged_sessions", "Sessions currently flagged by the loop guard.",
            registry=registry)
        self.compactions_per_session = Histogram(
            "compactd_session_compactions",
            "Committed automatic compactions of the session within the loop guard's window "
            "(counted up to max_compactions + 1), observed at each commit.",
            buckets=(1, 2, 3, 5, 10, 20, 50, 100), registry=registry)
        self.model_tokens = Counter(
            "compactd_model_tokens",
            "Tokens the providers billed for summary calls, by candidate and kind "
            "(input includes cached; cached is the part of input read from the prompt cache).",
            ["candidate", "kind"], registry=registry)
        self.cost_usd = Counter(
            "compactd_cost_usd",
            "USD the summary calls cost at the configured prices (compactd.worker.cost), by "
            "candidate and kind (input: fresh input; cached; cache_write; output). A "
            "candidate without a price is not counted.",
            ["candidate", "kind"], registry=registry)
        self.in_flight = Gauge(
            "compactd_runs_in_flight", "Compaction runs in progress in this worker.",
            registry=registry)
        self.pressure_to_checkpoint = Histogram(
            "compactd_pressure_to_checkpoint_seconds",
            "From a session's pending-signal mark to the commit of the first checkpoint of "
            "the automatic run that answered it.",
            ["trigger"], buckets=LATENCY_BUCKETS, registry=registry)
        self.retention_purged = Counter(
            "compactd_retention_purged",
            "What retention's purge deleted: recall originals past retention.originals_days, "
            "sessions idle past retention.sessions_idle_days, and those sessions' rows, and "
            "append idempotency keys past retention.append_keys_hours.",
            ["what"], registry=registry)
        self.retention_last_run = Gauge(
            "compactd_retention_last_run_timestamp_seconds",
            "When retention's purge last finished (Unix time).", registry=registry)
        self.webhook_deliveries = Counter(
            "compactd_webhook_deliveries",
            "Webhook deliveries by event and result (delivered; retried: failed and tried "
            "again later).", ["event", "result"], registry=registry)
        self.webhook_dead_letters = Counter(
            "compactd_webhook_dead_letters",
            "Webhook deliveries given up after events.retries failed retries, by event.",
            ["event"], registry=registry)
        self.fleet = FleetCollector()
        registry.register(self.fleet)


# Runway buckets (seconds) of compactd_sessions_runway: how many growing sessions would reach
# their window within each.
RUNWAY_BUCKETS = (10, 30, 60, 120, 300, 600, 1800, 3600)
# A fleet snapshot older than this many sweep intervals is not served: another worker now runs
# the sweeps, and its numbers are the current ones.
FLEET_STALE_INTERVALS = 3


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """What the sweep measured of the whole fleet (from PostgreSQL and the broker), not of this
    worker: the least runways, the queue depths, the oldest pending signal."""

    taken_at: float  # time.monotonic()
    interval_s: float
    runways: tuple[float, ...]  # seconds, every growing session's
    queue_depths: dict[str, int]  # None-free: a queue the broker could not count is left out
    oldest_signal_age_s: float | None


class FleetCollector(Collector):
    """Serves the last :class:`FleetSnapshot` while it is fresh. Whichever worker ran the
    latest sweep serves current numbers; a worker whose last sweep is old serves none, so a
    ``min()`` over workers never picks up a stale runway."""

    def __init__(self) -> None:
        self._snapshot: FleetSnapshot | None = None

    def update(self, snapshot: FleetSnapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        # The families without samples: the registry checks their names against the others'.
        return iter(fleet_families(None))

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot
        if snap is None or (time.monotonic() - snap.taken_at
                            > FLEET_STALE_INTERVALS * snap.interval_s):
            return iter(())
        return iter(fleet_families(snap))


def fleet_families(snap: FleetSnapshot | None) -> list[Metric]:
    least = GaugeMetricFamily(
        "compactd_runway_min_seconds",
        "The least runway of any growing session: seconds before its run model's window at its "
        "current token growth (absent: no session is growing).")
    within = GaugeMetricFamily(
        "compactd_sessions_runway", "Growing sessions whose runway is at most le seconds.",
        labels=["le"])
    depth = GaugeMetricFamily("compactd_queue_depth", "Messages waiting in each queue.",
                              labels=["queue"])
    oldest = GaugeMetricFamily(
        "compactd_oldest_signal_age_seconds",
        "Age of the oldest pending-signal mark (a run asked for and not ended; 0: none).")
    if snap is not None:
        if snap.runways:
            least.add_metric([], min(snap.runways))
        for bound in RUNWAY_BUCKETS:
            within.add_metric([str(bound)], sum(1 for r in snap.runways if r <= bound))
        within.add_metric(["+Inf"], len(snap.runways))
        for queue, n in sorted(snap.queue_depths.items()):
            depth.add_metric([queue], n)
        oldest.add_metric([], snap.oldest_signal_age_s or 0.0)
    return [least, within, depth, oldest]


_metrics: Metrics | None = None
_metrics_lock = threading.Lock()


def metrics() -> Metrics:
    global _metrics
    if _metrics is None:
        # A task thread and the loop thread can both make the first call: two Metrics() would
        # register the same names twice in the global registry, which raises.
        with _metrics_lock:
            if _metrics is None:
                _metrics = Metrics()
    return _metrics


def serve(port: int, addr: str = "0.0.0.0") -> bool:
    """Start the endpoint; False (logged) when the port is taken, so a second worker on the same
    host degrades to no metrics rather than failing to boot."""
    if not port:
        return False
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=addr, registry=metrics().registry)
    except OSError as exc:
        logger.warning("metrics endpoint not started",
                       extra={"action": "metrics.port_taken", "port": port, "error": str(exc)})
        return False
    logger.info("metrics endpoint started", extra={"action": "metrics.serve", "port": port})
    return True
