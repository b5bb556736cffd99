"""Candidate order (model ownership), the unavailability memory, and client scoping."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from typing import Any

import pytest

from compactd.worker.llm.candidates import Availability, Candidate, candidate_order
from compactd.worker.llm.errors import Unavailable
from compactd.worker.llm.pool import ProviderPool
from compactd.worker.llm.provider import Attribution, Provider
from compactd.worker.llm.providers import build_provider
from compactd.worker.settings import ModelSpec, WorkerConfig

MODELS = (
    ModelSpec(name="mini", provider="openai", model="gpt-4o-mini"),
    ModelSpec(name="gpt-4o", provider="openai"),
    ModelSpec(name="claude", provider="anthropic", model="claude-sonnet-4-5"),
    ModelSpec(name="mini-alias", provider="openai", model="gpt-4o-mini"),
    ModelSpec(name="offline", provider="local"),
)


@pytest.mark.parametrize(("run", "summary", "default", "local", "expected"), [
    # No summary model: the run model summarizes.
    ("gpt-4o", None, None, False, ["gpt-4o"]),
    # A summary model goes first, the run model follows.
    ("gpt-4o", "mini", None, False, ["mini", "gpt-4o"]),
    # Then the default, then local.
    ("gpt-4o", "mini", "claude", True, ["mini", "gpt-4o", "claude", "local"]),
    # De-duplicated by name...
    ("mini", "mini", "mini", True, ["mini", "local"]),
    # ...and by endpoint: two names for one provider model are one candidate.
    ("mini-alias", "mini", None, False, ["mini"]),
    # A name that is not configured is skipped, never guessed into a provider.
    ("gpt-5-unconfigured", "mini", None, True, ["mini", "local"]),
    # No run model known: the summary model and the default.
    (None, "claude", "gpt-4o", False, ["claude", "gpt-4o"]),
    # ``local`` named explicitly, and a provider-local entry, are the same one candidate.
    ("gpt-4o", "local", None, True, ["local", "gpt-4o"]),
    ("gpt-4o", "offline", None, True, ["offline", "gpt-4o"]),
])
def test_candidate_order(run: str | None, summary: str | None, default: str | None, local: bool,
                         expected: list[str]) -> None:
    order = candidate_order(run_model=run, summary_model=summary, models=MODELS,
                            default_model=default, local_fallback=local)
    assert [c.name for c in order] == expected


def test_no_models_configured_means_local_even_with_fallback_off() -> None:
    order = candidate_order(run_model="gpt-4o", summary_model=None, models=(),
                            default_model=None, local_fallback=False)
    assert [c.name for c in order] == ["local"]
    assert order[0].is_local and order[0].spec is None


def test_unknown_run_model_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        candidate_order(run_model="never-configured-xyz", summary_model=None, models=MODELS,
                        default_model=None, local_fallback=True)
    warnings = [r for r in caplog.records if getattr(r, "action", "") == "llm.unknown_model"]
    assert len(warnings) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_availability_expires_with_the_clock() -> None:
    clock = Clock()
    memory = Availability(ttl_s=60, clock=clock)
    assert memory.mark("m", "key missing") is True
    assert memory.mark("m", "key missing") is False  # already marked: no second warning
    assert memory.reason("m") == "key missing"
    clock.now += 59.9
    assert memory.reason("m") == "key missing"
    clock.now += 0.2
    assert memory.reason("m") is None
    assert memory.mark("m", "key missing") is True  # a new window warns again


async def test_a_client_that_cannot_be_built_is_skipped_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    builds: list[str] = []

    def build(candidate: Candidate, **kwargs: Any) -> Provider:
        builds.append(candidate.name)
        return build_provider(candidate, **kwargs)

    pool = ProviderPool(availability=Availability(ttl_s=300, clock=clock),
                        env={"OTHER": "x"}, build=build)
    broken = Candidate.from_spec(ModelSpec(name="broken", provider="openai",
                                           api_key_env="COMPACTD_TEST_MISSING_KEY"))
    for _ in range(5):
        with pytest.raises(Unavailable, match="COMPACTD_TEST_MISSING_KEY is not set"):
            pool.get(broken)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken" in warnings[0].getMessage()
    assert builds == ["broken"]  # remembered: not even rebuilt while the window lasts
    clock.now += 301  # the window ends: one more try, one more warning
    with pytest.raises(Unavailable):
        pool.get(broken)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    assert builds == ["broken", "broken"]
    await pool.aclose()


@pytest.mark.parametrize(("spec", "reason"), [
    (ModelSpec(name="c", provider="openai-compatible", model="llama"), "needs base_url"),
    (ModelSpec(name="a", provider="anthropic", api_key_env="COMPACTD_TEST_NOPE"),
     "COMPACTD_TEST_NOPE is not set"),
    (ModelSpec(name="o", provider="openai"), "OPENAI_API_KEY is not set"),
])
async def test_build_failures_name_what_is_missing(spec: ModelSpec, reason: str) -> None:
    pool = ProviderPool(env={})
    with pytest.raises(Unavailable, match=reason):
        pool.get(Candidate.from_spec(spec))
    await pool.aclose()


async def test_openai_compatible_needs_no_key() -> None:
    pool = ProviderPool(env={})
    spec = ModelSpec(name="vllm", provider="openai-compatible", model="llama",
                     base_url="http://127.0.0.1:9/v1")
    provider = pool.get(Candidate.from_spec(spec))
    assert pool.get(Candidate.from_spec(spec)) is provider  # built once per loop
    await pool.aclose()


def test_a_pool_serves_one_event_loop() -> None:
    pool = ProviderPool(env={"K": "k"})
    spec = ModelSpec(name="m", provider="openai", api_key_env="K")

    async def use() -> None:
        pool.get(Candidate.from_spec(spec))

    asyncio.run(use())
    with pytest.raises(RuntimeError, match="one event loop"):
        asyncio.run(use())


def test_pools_from_the_worker_config() -> None:
    worker = WorkerConfig(attribution_header="x-purpose", attribution_value="bg",
                          unavailable_model_s=42)
    pool = ProviderPool.from_config(worker, env={})
    assert pool.attribution.headers() == {"x-purpose": "bg"}
    assert pool.availability.ttl_s == 42


def test_the_worker_imports_an_sdk_only_when_a_client_of_its_kind_is_built() -> None:
    """Importing anthropic costs ~1.4 s at every worker start; a fleet on OpenAI never pays it."""
    code = (
        "import sys, compactd.worker.tasks, compactd.worker.app\n"
        "from compactd.worker.llm.candidates import Candidate\n"
        "from compactd.worker.llm.provider import Attribution\n"
        "from compactd.worker.llm.providers import build_provider\n"
        "from compactd.worker.settings import ModelSpec\n"
        "assert not {'openai', 'anthropic'} & set(sys.modules), 'imported at start'\n"
        "spec = ModelSpec(name='mini', provider='openai', model='gpt-4o-mini')\n"
        "build_provider(Candidate.from_spec(spec), attribution=Attribution(),\n"
        "               env={'OPENAI_API_KEY': 'k'})\n"
        "assert 'openai' in sys.modules and 'anthropic' not in sys.modules\n"
        "from compactd.worker.llm.providers import import_sdks\n"
        "claude = ModelSpec(name='claude', provider='anthropic', model='claude-sonnet-4-5')\n"
        "assert import_sdks([claude, spec]) == ['anthropic', 'openai']\n"
        "assert 'anthropic' in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(("provider", "env"), [("openai", {"OPENAI_API_KEY": "k"}),
                                               ("anthropic", {"ANTHROPIC_API_KEY": "k"})])
async def test_remote_clients_use_their_sdks_aiohttp_client(provider: str,
                                                            env: dict[str, str]) -> None:
    """The SDKs' aiohttp client parses HTTP in C: ~6% less worker CPU per compaction."""
    import importlib

    sdk = importlib.import_module(provider)
    spec = ModelSpec(name="m", provider=provider, model="some-model")  # type: ignore[arg-type]
    built: Any = build_provider(Candidate.from_spec(spec), attribution=Attribution(), env=env)
    try:
        assert isinstance(built._client._client, sdk.DefaultAioHttpClient)
    finally:
        await built.aclose()
