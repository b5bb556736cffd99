"""Cost in dollars, where an operator looks: a real worker compacts through the fake provider, and
the run's recorded usage at the configured ``prices:`` shows in ``compact --json`` (queued and
inline), ``compactd status [ID] --json``, the HTTP routes of ``compactd serve`` and the worker's
``compactd_cost_usd_total``; a corrected price reprices what the CLI reads."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import yaml

from compactd.scheduler.samples import coding_session
from compactd.worker.cost import NO_USAGE, PRICED
from tests.support.api import TOKEN_A, bearer, start_api
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.metrics import scrape, value
from tests.support.probes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

# Manual runs only: an automatic one holding the lease would make a manual one busy.
POLICY = {"model_name": "fake-gpt", "trigger": [{"type": "tokens", "value": 10_000_000}],
          "keep": {"type": "messages", "value": 6}}
PRICE = {"input": 2.0, "cached_input": 0.5, "output": 8.0}
CACHED = 1024  # what the fake says each fake-gpt call read from the cache


def expected_usd(counts: dict[str, int], price: dict[str, float]) -> dict[str, float]:
    fresh = counts["input_tokens"] - counts["cached_tokens"]
    return {"input": fresh * price["input"] / 1e6,
            "cached": counts["cached_tokens"] * price["cached_input"] / 1e6,
            "output": counts["output_tokens"] * price["output"] / 1e6}


def session_messages(seed: int) -> list[dict[str, Any]]:
    return coding_session(steps=12, big_output_lines=30, seed=seed).messages


def test_prices_turn_recorded_usage_into_dollars_on_every_surface(
        make_stack: Any, fake: FakeProvider) -> None:
    fake.script(Behaviour(model="fake-gpt", cached_tokens=CACHED, times=2))
    stack = make_stack(summarization=POLICY, extra_config={"prices": {"fake-gpt": PRICE}})
    url = start_api(stack)
    port = free_port()
    stack.start_worker("w1", concurrency=2, env={"COMPACTD_METRICS_PORT": str(port)})
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=120) as http:
        for sid, seed in (("c1", 1), ("c2", 2)):
            assert http.put(f"/v1/sessions/{sid}",
                            json={"run_model": "fake-gpt"}).status_code == 201
            assert http.post(f"/v1/sessions/{sid}/messages",
                             json={"messages": session_messages(seed)}).status_code == 200
        # The HTTP compact route: the run and its cost.
        run = http.post("/v1/sessions/c1/compact", json={"wait": True, "timeout_s": 90}).json()
        assert run["outcome"] == "committed", run
        usage = run["usage"]["by_candidate"]["fake-gpt"]
        assert usage["cached_tokens"] == CACHED * usage["calls"] > 0
        parts = expected_usd(usage, PRICE)
        usd = sum(parts.values())
        assert run["cost"] == {"usd": pytest.approx(usd, abs=1e-6), "basis": PRICED,
                               "by_candidate": {"fake-gpt": pytest.approx(usd, abs=1e-6)}}
        # The HTTP status route: per run and for the session.
        status = http.get("/v1/sessions/c1").json()
        assert status["runs"][0]["cost"] == run["cost"]
        assert status["cost"]["usd"] == pytest.approx(usd, abs=1e-6)
        assert status["cost"]["billed_runs"] == 1

    # compact --json through the queue (a second, cheaper run: no cached tokens left scripted
    # for it, so its cost differs from the first's).
    second = stack.cli_json("compact", "c2", "--wait")
    assert second["outcome"] == "committed", second
    two = second["usage"]["by_candidate"]["fake-gpt"]
    assert second["cost"]["usd"] == pytest.approx(sum(expected_usd(two, PRICE).values()),
                                                  abs=1e-6)

    # status ID --json: each run and the session's total over all its runs.
    body = stack.cli_json("status", "c1")
    assert body["runs"][0]["cost"] == run["cost"]
    assert body["cost"] == {"usd": pytest.approx(usd, abs=1e-6), "basis": PRICED,
                            "by_candidate": {"fake-gpt": pytest.approx(usd, abs=1e-6)},
                            "billed_runs": 1}
    # status --json: the sessions that cost most, most first.
    costliest = stack.cli_json("status")["costliest"]
    assert [c["session"] for c in costliest] == sorted(
        ["c1", "c2"], key=lambda s: -{"c1": usd, "c2": second["cost"]["usd"]}[s])
    assert {c["session"]: c["usd"] for c in costliest} == {
        "c1": pytest.approx(usd, abs=1e-6), "c2": pytest.approx(second["cost"]["usd"], abs=1e-6)}
    assert "costliest sessions" in stack.cli("status").stdout

    # The worker's counter, by candidate and kind, at the prices it started with.
    scraped = scrape(port)
    for kind in ("input", "cached", "output"):
        both = parts[kind] + expected_usd(two, PRICE)[kind]
        assert value(scraped, "compactd_cost_usd_total", candidate="fake-gpt",
                     kind=kind) == pytest.approx(both, abs=1e-9), kind

    # A corrected price reprices every stored run when it is read.
    config = yaml.safe_load(stack.config_path.read_text())
    doubled = {k: 2 * v for k, v in PRICE.items()}
    config["prices"] = {"fake-gpt": doubled}
    stack.config_path.write_text(yaml.safe_dump(config))
    repriced = stack.cli_json("status", "c1")
    assert repriced["runs"][0]["cost"]["usd"] == pytest.approx(2 * usd, abs=1e-6)
    assert repriced["cost"]["usd"] == pytest.approx(2 * usd, abs=1e-6)
    # Without a price for the candidate that billed, no total pretends to be one.
    config["prices"] = {}
    stack.config_path.write_text(yaml.safe_dump(config))
    unpriced = stack.cli_json("status", "c1")
    assert unpriced["cost"]["usd"] is None
    assert unpriced["cost"]["basis"] == "no price for fake-gpt in prices:"

    # compact --inline --json: the CLI's own run, at the price it read.
    config["prices"] = {"fake-gpt": PRICE}
    stack.config_path.write_text(yaml.safe_dump(config))
    inline = stack.cli_json("compact", "c1", "--inline", "--force")
    assert (inline["outcome"], inline["model"]) == ("committed", "fake-gpt"), inline
    billed = inline["usage"]["by_candidate"]["fake-gpt"]
    assert inline["cost"]["usd"] == pytest.approx(sum(expected_usd(billed, PRICE).values()),
                                                  abs=1e-6), inline["cost"]
    assert inline["cost"]["usd"] > 0

    # A run the local summarizer writes (every remote call refused) billed nothing, costs 0
    # and says so.
    fake.script(Behaviour(model="fake-gpt", status=400, times=-1))
    local = stack.cli_json("compact", "c2", "--inline", "--force")
    assert local["outcome"] == "committed" and local["model"] == "local", local
    assert local["cost"] == {"usd": 0.0, "basis": NO_USAGE, "by_candidate": {}}

    # The HTTP overflow route answers with the run it forced, at the server's price.
    fake.reset()
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=120) as http:
        assert http.put("/v1/sessions/c3", json={"run_model": "fake-gpt"}).status_code == 201
        assert http.post("/v1/sessions/c3/messages",
                         json={"messages": session_messages(3)}).status_code == 200
        overflow = http.post("/v1/sessions/c3/overflow",
                             json={"wait": True, "timeout_s": 90}).json()
    assert overflow["compacted"], overflow
    forced = overflow["run"]["usage"]["by_candidate"]["fake-gpt"]
    assert overflow["run"]["cost"]["usd"] == pytest.approx(
        sum(expected_usd(forced, PRICE).values()), abs=1e-6), overflow["run"]


def test_a_bad_price_is_refused_at_load_naming_the_key(make_stack: Any) -> None:
    for prices, says in (
            ({"fake-gpt": {"input": -1, "output": 2}},
             "prices.fake-gpt.input: must be greater than or equal to 0"),
            ({"fake-gpt": {"input": "cheap", "output": 2}},
             "prices.fake-gpt.input: must be a valid number"),
            ({"gpt-9": {"input": 1, "output": 2}},
             "prices.gpt-9: no model of that name in models, so no candidate uses it")):
        stack = make_stack(summarization=POLICY, extra_config={"prices": prices})
        out = stack.cli("status", check=False)
        assert out.returncode == 2, out
        assert says in out.stderr, out.stderr
