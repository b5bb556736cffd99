"""The Kubernetes manifests in ops/k8s/: valid against the Kubernetes API schemas (offline, the
``kubernetes-validate`` package's bundled schemas, strict: an unknown field is an error), the
KEDA ScaledObject by its structure (a custom resource: no bundled schema), and the same processes
as ops/compose.yaml and the systemd units, started the same way."""

from __future__ import annotations

import configparser
from pathlib import Path
from typing import Any

import pytest
import yaml

from compactd.worker.keys import QUEUE_BULK, QUEUE_PRESSURE, QUEUE_URGENT
from compactd.worker.settings import load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "ops" / "k8s"
COMPOSE = REPO / "ops" / "compose.yaml"
SYSTEMD = REPO / "ops" / "systemd"
PROCESSES = ("migrate", "worker", "beat", "serve", "flower")
# Where a process listens and what it calls itself differ by host kind on purpose (systemd binds
# Flower and serve to localhost and names workers by instance); every other argument is the same.
HOST_FLAGS = ("--hostname", "--address", "--host")


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _kind(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pod(component: str) -> dict[str, Any]:
    kind = "Job" if component == "migrate" else "Deployment"
    spec: dict[str, Any] = _kind(kind, f"compactd-{component}")["spec"]["template"]["spec"]
    return spec


def _container(component: str) -> dict[str, Any]:
    containers = _pod(component)["containers"]
    assert len(containers) == 1, component
    container: dict[str, Any] = containers[0]
    return container


def _env(component: str) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(component)["env"]}


def _normal(argv: list[str]) -> tuple[str, ...]:
    """The program's base name and its arguments, host-specific flag values left out."""
    out = [Path(argv[0]).name]
    for arg in argv[1:]:
        flag = arg.split("=", 1)[0]
        out.append(flag if flag in HOST_FLAGS else arg)
    return tuple(out)


def _broker_address(url: str) -> str:
    """host:port/db of a redis:// URL, its password left out."""
    return url.removeprefix("redis://").rsplit("@", 1)[-1]


def test_every_manifest_is_valid_against_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    checked = 0
    for doc in _docs():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: checked by structure below
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _docs()}
    assert {("Deployment", "compactd-worker"), ("Deployment", "compactd-beat"),
            ("Deployment", "compactd-serve"), ("Service", "compactd-serve"),
            ("Deployment", "compactd-flower"), ("Job", "compactd-migrate"),
            ("Deployment", "redis"), ("Service", "redis"),
            ("ConfigMap", "compactd-config"), ("ScaledObject", "compactd-worker"),
            ("TriggerAuthentication", "compactd-redis")} <= kinds
    assert checked == len([d for d in _docs() if not d["apiVersion"].startswith("keda.sh/")])


def test_a_manifest_the_schema_refuses_is_reported() -> None:
    # The validator is live: a misspelt field in a copy of the worker Deployment fails it.
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    broken = _kind("Deployment", "compactd-worker")
    broken["spec"]["replica"] = broken["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_the_processes_run_the_same_commands_as_compose_and_systemd() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    for component in PROCESSES:
        command = _container(component)["command"]
        assert command == compose[component]["command"], component
        if component == "migrate":
            continue  # systemd has no migrate unit: the RUNBOOK runs `compactd migrate` by hand
        unit_name = "compactd-worker@.service" if component == "worker" else \
            f"compactd-{component}.service"
        unit = configparser.RawConfigParser(strict=False, interpolation=None)
        unit.read_string((SYSTEMD / unit_name).read_text())
        assert _normal(command) == _normal(unit["Service"]["ExecStart"].split()), component


def test_every_process_gets_the_settings_compose_gives_it() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    for component in PROCESSES:
        env = _env(component)
        # (Bearer tokens excepted: each config file's api.tokens names its own variables.)
        wanted = {k for k in compose[component]["environment"]
                  if k.startswith("COMPACTD_") and not k.startswith("COMPACTD_TOKEN_")}
        assert wanted <= set(env), component
        # The database URL holds a password: from the Secret, never a literal.
        assert env["COMPACTD_DATABASE_URL"] == {
            "secretKeyRef": {"name": "compactd", "key": "database-url"}}, component
        # The same Redis, with the password from the Secret (compose: from its environment).
        assert _broker_address(env["COMPACTD_BROKER_URL"]) == _broker_address(
            compose["worker"]["environment"]["COMPACTD_BROKER_URL"]), component
        assert env["COMPACTD_BROKER_URL"].startswith("redis://:$(REDIS_PASSWORD)@"), component
        names = [e["name"] for e in _container(component)["env"]]
        # Kubernetes expands $(VAR) only from variables defined before it.
        assert names.index("REDIS_PASSWORD") < names.index("COMPACTD_BROKER_URL"), component
        assert env["REDIS_PASSWORD"] == {
            "secretKeyRef": {"name": "compactd", "key": "redis-password"}}, component
        mounts = {m["mountPath"]: m for m in _container(component)["volumeMounts"]}
        config = env["COMPACTD_CONFIG"]
        assert mounts[str(Path(config).parent)]["readOnly"] is True, component
        assert env["COMPACTD_HOME"] in mounts, f"{component}: COMPACTD_HOME is not writable"
        # Only workers call models, so only they get provider keys.
        keys = [k for k in env if k.endswith("_API_KEY")]
        assert bool(keys) == (component == "worker"), component


def test_the_config_map_is_a_config_that_loads(tmp_path: Path) -> None:
    data = _kind("ConfigMap", "compactd-config")["data"]
    path = tmp_path / "compactd.yaml"
    path.write_text(data[Path(_env("worker")["COMPACTD_CONFIG"]).name])
    config = load_config({}, path=str(path))
    assert config.models
    # The worker's probes and metrics port are the configured endpoint.
    ports = {p["name"]: p["containerPort"] for p in _container("worker")["ports"]}
    assert ports["metrics"] == config.worker.metrics_port
    grace = _pod("worker")["terminationGracePeriodSeconds"]
    assert grace >= config.worker.deadline_s, "a warm shutdown must outlast the longest run"


def test_beat_is_one_replica_replaced_never_rolled() -> None:
    beat = _kind("Deployment", "compactd-beat")["spec"]
    assert beat["replicas"] == 1
    assert beat["strategy"] == {"type": "Recreate"}


def test_flower_takes_its_basic_auth_from_a_secret_and_is_not_exposed() -> None:
    assert _env("flower")["FLOWER_BASIC_AUTH"] == {
        "secretKeyRef": {"name": "compactd", "key": "flower-basic-auth"}}
    service = _kind("Service", "compactd-flower")["spec"]
    assert service["type"] == "ClusterIP"


def test_keda_scales_the_workers_on_the_live_queues() -> None:
    scaled = _kind("ScaledObject", "compactd-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == "compactd-worker"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    # Scaling in must wait at least one warm shutdown.
    assert spec["cooldownPeriod"] >= _pod("worker")["terminationGracePeriodSeconds"]
    host_port, db = _broker_address(_env("worker")["COMPACTD_BROKER_URL"]).split("/")
    auth = _kind("TriggerAuthentication", "compactd-redis")["spec"]["secretTargetRef"]
    assert auth == [{"parameter": "password", "name": "compactd", "key": "redis-password"}]
    lists = set()
    for trigger in spec["triggers"]:
        assert trigger["type"] == "redis"
        assert trigger["authenticationRef"] == {"name": "compactd-redis"}
        meta = trigger["metadata"]
        assert (meta["address"], meta["databaseIndex"]) == (host_port, db)
        assert int(meta["listLength"]) >= 1
        lists.add(meta["listName"])
    assert lists == {QUEUE_URGENT, QUEUE_PRESSURE}
    assert QUEUE_BULK not in lists


def test_redis_requires_the_password_every_client_is_given() -> None:
    redis = _kind("Deployment", "redis")["spec"]["template"]["spec"]["containers"][0]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e.get("valueFrom") for e in redis["env"]}
    secret = {"secretKeyRef": {"name": "compactd", "key": "redis-password"}}
    assert env["REDIS_PASSWORD"] == secret and env["REDISCLI_AUTH"] == secret
    service = _kind("Service", "redis")["spec"]
    host_port = _broker_address(_env("worker")["COMPACTD_BROKER_URL"]).split("/")[0]
    assert host_port == f"redis:{service['ports'][0]['port']}"


def test_serve_is_a_service_with_its_token_from_the_secret() -> None:
    env = _env("serve")
    assert env["COMPACTD_API_TOKEN"] == {
        "secretKeyRef": {"name": "compactd", "key": "api-token"}}
    data = _kind("ConfigMap", "compactd-config")["data"]["compactd.yaml"]
    tokens = yaml.safe_load(data)["api"]["tokens"]
    assert {"tenant": "default", "token_env": "COMPACTD_API_TOKEN"} in tokens
    port = {p["name"]: p["containerPort"] for p in _container("serve")["ports"]}["http"]
    assert f"--port={port}" in _container("serve")["command"]
    assert _container("serve")["readinessProbe"]["httpGet"]["path"] == "/healthz"
    service = _kind("Service", "compactd-serve")["spec"]
    assert service["type"] == "ClusterIP" and service["ports"][0]["targetPort"] == "http"
