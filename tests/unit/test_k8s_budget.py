"""The PostgreSQL connections the Kubernetes manifests can open, added up from the manifests and
the code's own pool sizes, against the budget ops/RUNBOOK.md states ("Connection budget"): at
KEDA's maxReplicaCount every worker pod holds its whole pool, every serve replica its pool and
the overflow, and a migration Job runs beside them during a release."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from compactd.scheduler.http.server import POOL_SIZE
from compactd.storage.database import create_engine
from compactd.worker.settings import load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "ops" / "k8s"
RUNBOOK = REPO / "ops" / "RUNBOOK.md"
# A URL no one connects to: the engines below are built for their pool sizes only.
NOWHERE = "postgresql://compactd@localhost:5432/compactd"


def _docs(k8s: Path) -> list[dict[str, Any]]:
    docs = []
    for path in sorted(k8s.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found[0] if found else None


def _engine_limit(**kwargs: Any) -> int:
    """The most connections an engine built as compactd builds it may hold."""
    engine = create_engine(NOWHERE, **kwargs)
    try:
        pool: Any = engine.sync_engine.pool
        return int(pool.size() + max(pool._max_overflow, 0))
    finally:
        engine.sync_engine.dispose()


def connection_total(k8s: Path, tmp_path: Path) -> dict[str, int]:
    """Connections per process kind at the manifests' largest scale."""
    docs = _docs(k8s)
    config_map = _find(docs, "ConfigMap", "compactd-config")
    assert config_map is not None
    config_file = tmp_path / "compactd.yaml"
    config_file.write_text(config_map["data"]["compactd.yaml"])
    config = load_config({}, path=str(config_file))
    total: dict[str, int] = {}
    # A worker process: worker.db_pool_size connections and no overflow (worker.runtime).
    worker_pool = _engine_limit(pool_size=config.worker.db_pool_size, max_overflow=0)
    worker = _find(docs, "Deployment", "compactd-worker")
    scaled = _find(docs, "ScaledObject", "compactd-worker")
    assert worker is not None
    replicas = worker["spec"]["replicas"]
    if scaled is not None:
        replicas = max(replicas, scaled["spec"]["maxReplicaCount"])
    total["worker"] = replicas * worker_pool
    serve = _find(docs, "Deployment", "compactd-serve")
    total["serve"] = 0 if serve is None else \
        serve["spec"]["replicas"] * _engine_limit(pool_size=POOL_SIZE)
    # Beat and Flower only send and read Celery messages: no database connection.
    migrate = _find(docs, "Job", "compactd-migrate")
    total["migrate"] = 0 if migrate is None else _engine_limit(pool_size=1)
    return total


def runbook_budget() -> int:
    """The connections compactd may use, as the RUNBOOK states it."""
    found = re.search(r"connection budget is (\d+)", RUNBOOK.read_text())
    assert found, "ops/RUNBOOK.md states no connection budget"
    return int(found.group(1))


def test_the_manifests_at_their_largest_scale_stay_within_the_connection_budget(
        tmp_path: Path) -> None:
    total = connection_total(K8S, tmp_path)
    assert total["serve"] > 0, "no serve Deployment in ops/k8s"
    assert sum(total.values()) <= runbook_budget(), total


def test_the_budget_leaves_the_servers_reserved_connections_and_an_operators_cli() -> None:
    text = RUNBOOK.read_text()
    max_connections = int(re.search(r"`max_connections` \((\d+) by default\)", text)
                          .group(1))  # type: ignore[union-attr]
    # superuser_reserved_connections (3 by default), and a CLI process (a pool of 5 and as
    # many again) for the operator during a release.
    cli = _engine_limit(pool_size=5)
    assert runbook_budget() <= max_connections - 3 - cli


def test_a_worker_pool_or_a_replica_cap_past_the_budget_is_caught(tmp_path: Path) -> None:
    # The check is live: the pool size the manifests had before (the default, 20) at KEDA's
    # former cap of 20 replicas is 400 connections.
    copy = tmp_path / "k8s"
    copy.mkdir()
    for path in K8S.glob("*.yaml"):
        text = path.read_text()
        text = text.replace("db_pool_size: 10", "db_pool_size: 20")
        text = re.sub(r"maxReplicaCount: \d+", "maxReplicaCount: 20", text)
        (copy / path.name).write_text(text)
    total = connection_total(copy, tmp_path)
    assert total["worker"] == 400
    assert sum(total.values()) > runbook_budget()
