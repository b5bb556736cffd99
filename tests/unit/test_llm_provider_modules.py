"""Each provider in its own module, translating only its own SDK's exceptions, behind one
registry (issue 28): adding a provider is one module and one registry entry."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import compactd.worker.llm as llm
from compactd.worker.llm.providers import PROVIDERS
from compactd.worker.settings import ModelSpec
from tests.support.source import parse_file

LLM = Path(llm.__file__).parent
SDKS = {"openai", "anthropic"}


def _sdks_named(path: Path) -> set[str]:
    """The SDKs a module imports or reads attributes of (``openai.APIStatusError``)."""
    named = set()
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.Import):
            named |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            named.add(node.module.split(".")[0])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            named.add(node.value.id)
    return named & SDKS


def test_each_provider_module_names_only_its_own_sdk() -> None:
    assert _sdks_named(LLM / "openai_provider.py") == {"openai"}
    assert _sdks_named(LLM / "anthropic_provider.py") == {"anthropic"}


def test_the_shared_modules_name_no_sdk() -> None:
    for name in ("provider.py", "providers.py", "http_errors.py", "pool.py", "fallback.py"):
        assert _sdks_named(LLM / name) == set(), name


def test_the_registry_has_every_remote_provider_a_model_can_name() -> None:
    names = set(typing.get_args(ModelSpec.model_fields["provider"].annotation))
    assert set(PROVIDERS) == names - {"local"}
    assert {kind.sdk for kind in PROVIDERS.values()} == SDKS
