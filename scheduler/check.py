"""``compactd check``: is this configuration good to run on? The configuration (``COMPACTD_*``
and the YAML file of ``COMPACTD_CONFIG`` or ``--config``) has already loaded when the command
runs: an invalid one stops ``compactd`` before, naming the key, with exit code 2. Then every
configured model gets one small call, each bounded in time, and is reported reachable or not with
the error it gave.

Exit codes: 0 every model answered, 1 one did not, 2 the configuration is invalid.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from compactd.scheduler.output import EXIT_FAILED, EXIT_OK, emit, redact_url, say
from compactd.storage.kinds import ModelFailure
from compactd.worker.settings import Config, ModelSpec

# The longest one model's check waits for its answer (less when the model's timeout_s is less).
CHECK_TIMEOUT_S = 20.0
# Enough for any model to say something; the answer itself is not looked at.
CHECK_MAX_TOKENS = 16
CHECK_PROMPT = [{"role": "user", "content": "Reply with the word OK."}]
# Failures that come with an answer from the model: it is reachable.
ANSWERED = frozenset({ModelFailure.TRUNCATED, ModelFailure.EMPTY, ModelFailure.NON_TEXT,
                      ModelFailure.REFUSED})


@dataclass(frozen=True, slots=True)
class ModelCheck:
    name: str
    provider: str
    model: str
    base_url: str | None
    reachable: bool
    latency_s: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "provider": self.provider, "model": self.model,
                "base_url": self.base_url, "reachable": self.reachable,
                "latency_s": self.latency_s, "error": self.error}


async def check_model(spec: ModelSpec, config: Config) -> ModelCheck:
    """One minimal call to ``spec``'s model, bounded by :data:`CHECK_TIMEOUT_S`."""
    # Imported here for start-up time: every command registers check, only check builds clients.
    from compactd.worker.llm.candidates import Candidate
    from compactd.worker.llm.errors import ProviderError
    from compactd.worker.llm.provider import Attribution, BuildError
    from compactd.worker.llm.providers import build_provider

    def result(reachable: bool, error: str | None = None) -> ModelCheck:
        return ModelCheck(spec.name, spec.provider, spec.model_id,
                          redact_url(spec.base_url) if spec.base_url else None, reachable,
                          latency_s=_since(started) if reachable else None, error=error)

    timeout_s = min(CHECK_TIMEOUT_S, spec.timeout_s)
    started = time.monotonic()
    try:
        provider = build_provider(Candidate.from_spec(spec),
                                  attribution=Attribution.from_config(config.worker),
                                  env=os.environ)
    except (BuildError, ValueError) as exc:
        return result(False, f"unavailable: {exc}")
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            await provider.complete(CHECK_PROMPT, max_tokens=CHECK_MAX_TOKENS)
    except TimeoutError:
        return result(False, f"timeout: no answer within {timeout_s:g} s")
    except ProviderError as exc:
        if exc.kind in ANSWERED:
            return result(True)
        return result(False, f"{exc.kind}: {exc.reason}")
    finally:
        await provider.aclose()
    return result(True)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)


async def cmd_check(args: argparse.Namespace, config: Config) -> int:
    remote = [m for m in config.models if m.provider != "local"]
    # One call each, side by side: the slowest model bounds the command.
    results = await asyncio.gather(*(check_model(spec, config) for spec in remote))
    ok = all(r.reachable for r in results)
    if args.json:
        emit({"config": config.config_path, "valid": True, "ok": ok,
              "models": [r.to_json() for r in results]})
        return EXIT_OK if ok else EXIT_FAILED
    say(f"config {config.config_path or '(none: the built-in defaults)'}: valid, "
        f"{len(config.models)} model(s)")
    for r in results:
        where = f"{r.provider} {r.model}" + (f" at {r.base_url}" if r.base_url else "")
        if r.reachable:
            say(f"  {r.name} ({where}): reachable, answered in {r.latency_s:g} s")
        else:
            say(f"  {r.name} ({where}): UNREACHABLE: {r.error}")
    say("  local (the built-in summarizer): nothing to reach")
    return EXIT_OK if ok else EXIT_FAILED


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="validate the configuration and reach every model once")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_check)
