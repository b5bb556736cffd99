"""docs/reference/ is generated from the code (ops/gen_docs.py) and must be current: a setting,
a route or a status added without `python ops/gen_docs.py` fails here, naming the page."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import ModuleType

import pytest
from pydantic import BaseModel

from compactd.worker.compaction import policy
from compactd.worker.settings import FileConfig, Settings
from tests.support.stack import REPO


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "ops" / "gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _load()


@pytest.mark.parametrize("page", sorted(gen_docs.GENERATORS))
def test_the_generated_page_is_current(page: str) -> None:
    path = gen_docs.PAGES[page]
    assert path.read_text(encoding="utf-8") == gen_docs.GENERATORS[page](), (
        f"{path.relative_to(REPO)} is stale: run python ops/gen_docs.py")


def _paths(model: type[BaseModel], prefix: str) -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        nested = gen_docs._nested_model(field.annotation)
        if nested is not None:
            out += _paths(nested, f"{prefix}{name}.")
    return out


def test_every_setting_is_in_the_configuration_reference() -> None:
    page = gen_docs.PAGES["configuration"].read_text(encoding="utf-8")
    for name in Settings.model_fields:
        assert f"`COMPACTD_{name.upper()}`" in page, name
    # The page writes models[].name and prices.<model name>.input; the model's paths are dotted.
    dotted = page.replace("[].", ".").replace(".<model name>.", ".")
    paths = _paths(FileConfig, "")
    assert "worker.loop_guard.window_s" in paths and "prices.input" in paths
    for path in paths:
        assert f"`{path}`" in dotted, path
    for key in policy._TOP_KEYS | {"lead"}:
        assert f"`summarization.{key}`" in page, key
    for key in policy._PRUNE_KEYS:
        assert f"`summarization.prune.{key}`" in page, key
    for key in policy._CLEAR_KEYS:
        assert f"`summarization.clear_tool_uses.{key}`" in page, key
    assert {f.name for f in dataclasses.fields(policy.Policy)} >= policy._TOP_KEYS


def test_every_route_and_status_is_in_the_http_reference() -> None:
    from compactd.scheduler.http.server import create_app
    from compactd.worker.settings import build_config

    config = build_config({"api": {"tokens": [{"tenant": "t", "token_sha256": "0" * 64}]}},
                          settings=Settings(database_url="sqlite:////nonexistent/x.sqlite3"))
    doc = create_app(config, environ={}).openapi()
    page = gen_docs.PAGES["http"].read_text(encoding="utf-8")
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            section = page.split(f"## `{method.upper()} {path}`\n", 1)[1].split("\n## ", 1)[0]
            for code in op["responses"]:
                assert f"\n| {code} |" in section, (method, path, code)


def test_example_comments_follow_the_yaml_nesting() -> None:
    comments = gen_docs.example_comments(
        "models:\n  - name: a   # the name\n    provider: openai  # which API\n"
        "worker:\n  loop_guard:\n    margin: 0.1  # relief\n  lease_s: 60  # seconds\n")
    assert comments == {"models[].name": "the name", "models[].provider": "which API",
                        "worker.loop_guard.margin": "relief", "worker.lease_s": "seconds"}
