"""``compactd check`` as an operator runs it before starting the processes: the configuration
validated (a bad file names its key, exit 2), then one call to every configured model over HTTP
(the fake provider answers; a dead port does not: exit 1, naming the model and its error)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.fake_provider import FakeProvider
from tests.support.probes import free_port
from tests.support.stack import FAKE_KEY_ENV, REPO, fake_models


def _check(tmp_path: Path, config: dict[str, Any] | str, *args: str
           ) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "compactd.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
    env.update(PYTHONPATH=str(REPO), COMPACTD_HOME=str(tmp_path), COMPACTD_CONFIG=str(path),
               **{FAKE_KEY_ENV: "sk-fake-test-key"})
    return subprocess.run([sys.executable, "-m", "compactd.scheduler.cli", "check", *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_check_reaches_every_model_once_and_exits_0(fake: FakeProvider, tmp_path: Path) -> None:
    models = fake_models(fake.url)
    out = _check(tmp_path, {"models": models}, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    body = json.loads(out.stdout)
    assert body["valid"] is True and body["ok"] is True
    assert [m["name"] for m in body["models"]] == [m["name"] for m in models]
    assert all(m["reachable"] and m["error"] is None for m in body["models"]), body
    # One call per model, no retries.
    assert sorted(r.model or "" for r in fake.requests) == sorted(m["model"] for m in models)
    text = _check(tmp_path, {"models": models})
    assert text.returncode == 0, text.stdout + text.stderr
    assert f"{models[0]['name']} (" in text.stdout and "reachable" in text.stdout


def test_check_names_an_unreachable_model_with_its_error_and_exits_1(
        fake: FakeProvider, tmp_path: Path) -> None:
    dead = {"name": "dead-model", "provider": "openai-compatible", "model": "ghost",
            "base_url": f"http://127.0.0.1:{free_port()}/v1", "api_key_env": FAKE_KEY_ENV,
            "timeout_s": 5}
    out = _check(tmp_path, {"models": [*fake_models(fake.url)[:1], dead]})
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    [line] = [x for x in lines if x.strip().startswith("dead-model ")]
    assert "UNREACHABLE: connection:" in line, out.stdout
    assert any(x.strip().startswith("fake-gpt ") and ": reachable" in x for x in lines), lines
    body = json.loads(_check(tmp_path, {"models": [dead]}, "--json").stdout)
    assert body["ok"] is False
    assert body["models"][0]["reachable"] is False and body["models"][0]["error"]


def test_check_refuses_an_invalid_config_naming_the_key_and_exits_2(tmp_path: Path) -> None:
    out = _check(tmp_path, {"models": [{"name": "m", "provider": "openia"}]})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "models[0].provider" in out.stderr, out.stderr
    out = _check(tmp_path, "worker:\n  concurency: 4\n")
    assert out.returncode == 2 and "worker.concurency: unknown key" in out.stderr, out.stderr
    out = _check(tmp_path, "models: [\n")
    assert out.returncode == 2 and "invalid YAML" in out.stderr, out.stderr
