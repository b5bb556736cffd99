"""The deployment files in ops/: the compose file, the systemd units, the alert rules.

Each is checked by the real tool where this machine has it (``docker compose config`` or
``docker-compose config``, ``systemd-analyze verify``), and always by a structural check that
stands in where it does not and catches what the tools do not look at (a unit that starts the
wrong process, an alert on a metric the worker does not export).
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from compactd.worker.metrics import FleetSnapshot, Metrics, fleet_families
from compactd.worker.settings import load_config
from tests.support.services import debian_packages_settled

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
COMPOSE = OPS / "compose.yaml"
UNITS = sorted((OPS / "systemd").glob("*.service"))
ALERTS = OPS / "prometheus" / "alerts.yaml"
FAILURE_CLASSES = {"busy", "cancelled", "changed", "summary", "commit", "persistence",
                   "abandoned"}


# ------------------------------------------------------------------------------------- compose


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert isinstance(command, list), "commands are exec-form lists (no shell in between)"
    return [str(part) for part in command]


def test_compose_has_every_service_with_image_command_and_environment() -> None:
    services = _compose()["services"]
    assert set(services) == {"postgres", "redis", "migrate", "worker", "beat", "serve",
                             "flower"}
    for name, service in services.items():
        assert service.get("image"), f"{name}: no image"
        assert service.get("restart") in ("unless-stopped", "no", "always", "on-failure"), name
    compactd = {name: services[name] for name in ("migrate", "worker", "beat", "serve",
                                                  "flower")}
    for name, service in compactd.items():
        assert service["build"]["dockerfile"] == "ops/Dockerfile", name
        assert (COMPOSE.parent / service["build"]["context"] / "ops" / "Dockerfile").is_file()
        env = service["environment"]
        for key in ("COMPACTD_DATABASE_URL", "COMPACTD_BROKER_URL", "COMPACTD_CONFIG"):
            assert env.get(key), f"{name}: {key} missing"
        assert env["COMPACTD_LOG_FORMAT"] == "json", name
        assert "@postgres:5432/" in env["COMPACTD_DATABASE_URL"], name
        # Redis requires a password (--requirepass); every client's URL carries it.
        assert env["COMPACTD_BROKER_URL"].startswith(
            "redis://:${REDIS_PASSWORD:-compactd}@redis:6379/"), name
    assert _command(services["migrate"]) == ["compactd", "migrate"]
    assert _command(services["serve"])[:2] == ["compactd", "serve"]
    # serve needs a token in api.tokens, which the README's local config has none of: asked for.
    assert services["serve"]["profiles"] == ["api"]
    redis = _command(services["redis"])
    assert redis[redis.index("--requirepass") + 1] == "${REDIS_PASSWORD:-compactd}"
    for name in ("worker", "beat", "flower"):
        # --quiet: no start-up banner, so the process's output is JSON lines only.
        assert _command(services[name])[:5] == ["celery", "--quiet", "-A", "compactd.worker.app",
                                                name]
    # Only workers call models, so only they get provider keys.
    assert "OPENAI_API_KEY" in services["worker"]["environment"]
    for name in ("migrate", "beat", "serve", "flower"):
        assert not any(k.endswith("_API_KEY") for k in services[name]["environment"]), name


def test_compose_orders_start_up_with_health_checks() -> None:
    services = _compose()["services"]
    for name in ("postgres", "redis", "worker", "flower"):
        check = services[name]["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert check.get("interval") and check.get("retries"), name
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("worker", "beat"):
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"}}, name
    assert services["flower"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    # The worker's health check is its metrics endpoint, on the configured default port.
    port = load_config({}).worker.metrics_port
    assert f"127.0.0.1:{port}/metrics" in " ".join(services["worker"]["healthcheck"]["test"])
    # A warm shutdown outlasts the longest run.
    grace = int(str(services["worker"]["stop_grace_period"]).rstrip("s"))
    assert grace >= load_config({}).worker.deadline_s


def test_compose_flower_is_authenticated_persistent_and_local() -> None:
    flower = _compose()["services"]["flower"]
    assert "FLOWER_BASIC_AUTH" in flower["environment"]
    command = _command(flower)
    assert "--persistent=True" in command
    assert any(arg.startswith("--db=/var/lib/compactd/") for arg in command)
    assert flower["ports"] == ["127.0.0.1:5555:5555"]
    volumes = " ".join(flower["volumes"])
    assert "flowerdata:/var/lib/compactd" in volumes


def test_compose_mounts_a_config_that_loads() -> None:
    worker = _compose()["services"]["worker"]
    mount = next(v for v in worker["volumes"] if v.endswith(":/etc/compactd/compactd.yaml:ro"))
    default = re.fullmatch(r"\$\{COMPACTD_CONFIG_FILE:-(.+)\}:/etc/compactd/compactd.yaml:ro",
                           mount)
    assert default, mount
    config = load_config({}, path=str(COMPOSE.parent / default.group(1)))
    assert config.models


def _compose_tool() -> list[str] | None:
    debian_packages_settled()
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_config_validates_with_the_compose_tool() -> None:
    tool = _compose_tool()
    if tool is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed; the structural "
                    "checks above stand in")
    env = {**os.environ, "FLOWER_BASIC_AUTH": "admin:secret"}
    out = subprocess.run([*tool, "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = yaml.safe_load(out.stdout)
    assert set(rendered["services"]) == {"postgres", "redis", "migrate", "worker", "beat",
                                         "serve", "flower"}
    assert rendered["services"]["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "admin:secret"


# ------------------------------------------------------------------------------------- systemd


def _unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def test_systemd_units_start_the_right_processes_with_the_environment_file() -> None:
    names = {unit.name for unit in UNITS}
    assert names == {"compactd-worker@.service", "compactd-beat.service",
                     "compactd-serve.service", "compactd-flower.service"}
    for path in UNITS:
        unit = _unit(path)
        assert set(unit.sections()) == {"Unit", "Service", "Install"}, path.name
        assert unit["Unit"]["Description"]
        service = unit["Service"]
        # configparser keeps only the last of repeated keys: read the EnvironmentFile lines.
        env_files = re.findall(r"^EnvironmentFile=(.+)$", path.read_text(), re.MULTILINE)
        assert env_files[0] == "/etc/compactd/compactd.env", path.name
        assert service["User"] == "compactd" and service["Restart"] == "on-failure"
        argv = service["ExecStart"].split()
        process = path.name.removeprefix("compactd-").split("@")[0].split(".")[0]
        if process == "serve":
            assert argv[0].startswith("/") and argv[0].endswith("/compactd"), path.name
            assert argv[1] == "serve" and "--host=127.0.0.1" in argv, path.name
        else:
            assert argv[0].startswith("/") and argv[0].endswith("/celery"), path.name
            assert argv[1:5] == ["--quiet", "-A", "compactd.worker.app", process], path.name
        assert unit["Install"]["WantedBy"] == "multi-user.target"
    text = (OPS / "systemd" / "compactd-worker@.service").read_text()
    assert "EnvironmentFile=/etc/compactd/compactd.env" in text
    assert "EnvironmentFile=-/etc/compactd/worker-%i.env" in text
    assert "--hostname=%i@%H" in text
    flower = (OPS / "systemd" / "compactd-flower.service").read_text()
    assert "EnvironmentFile=/etc/compactd/flower.env" in flower
    assert "--persistent=True" in flower and "--address=127.0.0.1" in flower


def test_systemd_worker_stop_timeout_outlasts_a_run() -> None:
    service = _unit(OPS / "systemd" / "compactd-worker@.service")["Service"]
    assert service["KillSignal"] == "SIGTERM"  # Celery's warm shutdown
    assert int(service["TimeoutStopSec"]) >= load_config({}).worker.deadline_s


def test_systemd_environment_files_name_the_settings() -> None:
    env = dict(line.split("=", 1) for line in (OPS / "systemd" / "compactd.env").read_text()
               .splitlines() if line and not line.startswith("#"))
    for key in ("COMPACTD_DATABASE_URL", "COMPACTD_BROKER_URL", "COMPACTD_CONFIG",
                "COMPACTD_LOG_FORMAT"):
        assert key in env, key
    assert env["COMPACTD_LOG_FORMAT"] == "json"
    flower = (OPS / "systemd" / "flower.env").read_text()
    assert re.search(r"^FLOWER_BASIC_AUTH=\S+:\S+$", flower, re.MULTILINE)


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed; the structural checks above stand in")
    system = Path("/usr/lib/systemd/system")
    if not (system / "multi-user.target").exists():
        pytest.skip("no systemd unit directory to verify against")
    # A root of our own: the host's stock units, ours, and the executables they start (verify
    # refuses a unit whose ExecStart does not exist).
    root = tmp_path / "root"
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for path in UNITS:
        shutil.copy(path, units / path.name)
        exe = root / _unit(path)["Service"]["ExecStart"].split()[0].lstrip("/")
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    names = [p.name.replace("@.service", "@1.service") for p in UNITS]
    out = subprocess.run(["systemd-analyze", "verify", f"--root={root}", *names],
                         capture_output=True, text=True, timeout=120)
    # verify exits 0 on mere warnings (an unknown key is "ignored"): any output is a finding.
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


# -------------------------------------------------------------------------------------- alerts


def _exported() -> dict[str, tuple[str, set[str]]]:
    """Every sample name the worker exports, with its metric's type and label names."""
    m = Metrics(CollectorRegistry())
    out: dict[str, tuple[str, set[str]]] = {}
    for metric in vars(m).values():
        name = getattr(metric, "_name", None)
        if name is None:
            continue
        kind, labels = metric._type, set(metric._labelnames)
        suffixes = {"counter": ["_total"], "gauge": [""],
                    "histogram": ["_bucket", "_count", "_sum"]}[kind]
        for suffix in suffixes:
            out[name + suffix] = (kind, labels | ({"le"} if suffix == "_bucket" else set()))
    # The fleet's gauges, served by a collector (its families' label names are fixed).
    fleet = FleetSnapshot(0.0, 1.0, (1.0,), {"q": 1}, 1.0)
    for family in fleet_families(fleet):
        out[family.name] = (family.type, {k for s in family.samples for k in s.labels})
    return out


def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    assert set(data) == {"groups"}
    rules: list[dict[str, Any]] = []
    for group in data["groups"]:
        assert set(group) == {"name", "rules"} and group["rules"]
        rules.extend(group["rules"])
    return rules


def test_alert_rules_have_the_prometheus_rule_shape() -> None:
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations",
                             "keep_firing_for"}, rule["alert"]
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"])
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert re.fullmatch(r"\d+[smhd]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("page", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert anchor in _runbook_anchors(), f"{rule['alert']}: no runbook section {anchor}"
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")


def test_alert_rules_cover_the_issue_and_use_only_exported_metrics() -> None:
    exported = _exported()
    used: set[str] = set()
    for rule in _rules():
        expr = rule["expr"]
        for match in re.finditer(r"\b(compactd_[a-z_]+)(\{[^}]*\})?", expr):
            name, selector = match.group(1), match.group(2) or ""
            assert name in exported, f"{rule['alert']}: the worker exports no {name}"
            used.add(name)
            labels = set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", selector))
            assert labels <= exported[name][1], f"{rule['alert']}: {name} has no {labels}"
            for value in re.findall(r'failure_class\s*(?:=~|!~|!=|=)\s*"([^"]*)"', selector):
                assert set(value.split("|")) <= FAILURE_CLASSES, value
        for by in re.findall(r"by \(([^)]*)\)", expr):
            names = re.findall(r"\b(compactd_[a-z_]+)", expr)
            allowed = set().union(*(exported[n][1] for n in names)) if names else set()
            assert {b.strip() for b in by.split(",")} <= allowed | {"instance", "job"}
    # The issue's four: failure ratio, abandoned leases, loop guard, queue lag; and the
    # runway's (issue 18).
    assert {"compactd_compactions_total", "compactd_lease_reaps_total",
            "compactd_loop_guard_flags_total", "compactd_queue_wait_seconds_bucket",
            "compactd_pressure_to_checkpoint_seconds_bucket",
            "compactd_runway_min_seconds"} <= used


def test_the_runway_alert_compares_the_checkpoint_p99_with_the_least_runway() -> None:
    rule = next(r for r in _rules() if r["alert"] == "CompactdRunwayShort")
    expr = " ".join(rule["expr"].split())
    assert expr == ("histogram_quantile(0.99, sum by (le) "
                    "(rate(compactd_pressure_to_checkpoint_seconds_bucket[10m]))) "
                    "> 0.5 * min(compactd_runway_min_seconds)")


def _runbook_anchors() -> set[str]:
    text = (OPS / "RUNBOOK.md").read_text()
    return {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
