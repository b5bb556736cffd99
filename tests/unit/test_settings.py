from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from compactd.storage.errors import ConfigError
from compactd.worker.compaction.policy import Clause, Policy
from compactd.worker.settings import build_config, load_config

REPO = Path(__file__).resolve().parents[2]


def cfg(text: str):  # type: ignore[no-untyped-def]
    return build_config(yaml.safe_load(text) or {})


@pytest.mark.parametrize(("text", "error"), [
    ("summarization: {trigger: {type: tokens, value: .nan}}",
     "summarization.trigger.value: must be a finite number"),
    ("summarization: {trigger: {type: tokens, value: .inf}}",
     "summarization.trigger.value: must be a finite number"),
    ("summarization: {trigger: {type: fraction, value: 80}}",
     "summarization.trigger.value: a fraction must be in (0, 1], got 80 (write 0.8 for 80%)"),
    ("summarization: {trigger: {type: fraction, value: 0}}",
     "summarization.trigger.value: a fraction must be in (0, 1]"),
    ("summarization: {trigger: [{type: tokens, value: 4000}, {type: messages, value: 2.5}]}",
     "summarization.trigger[1].value: must be an integer, got 2.5"),
    ("summarization: {trigger: {type: messages, value: -3}}",
     "summarization.trigger.value: must be positive"),
    ("summarization: {keep_at: landing}",
     "summarization.keep_at: must be one of pickup, claim, got 'landing'"),
    ("summarization: {keep_at: null}", "summarization.keep_at: must be one of pickup, claim"),
    ("summarization: {trigger: {type: tokens, value: 0}}",
     "summarization.trigger.value: must be positive"),
    ("summarization: {trigger: [{}]}",
     "summarization.trigger[0]: an empty trigger mapping never fires"),
    ("summarization: {trigger: {type: pages, value: 3}}",
     "summarization.trigger.type: unknown kind 'pages'"),
    ("summarization: {trigger: [[tokens, 4000], [fraction, 1.5]]}",
     "summarization.trigger[1][1]: a fraction must be in (0, 1]"),
    ("summarization: {trigger: [{tokens: 4000, bogus: 3}]}",
     "summarization.trigger[0].bogus: unknown trigger kind"),
    ("summarization: {summary_prompt: 'Summarize please'}",
     "summarization.summary_prompt: a custom prompt must contain the {messages} placeholder"),
    ("summarization: {trigger_tokens: 5}", "summarization.trigger_tokens: unknown key"),
    ("summarization: {prune: {threshold: 5}}", "summarization.prune.threshold: unknown key"),
    ("summarization: {trigger: {type: messages, value: 20}, keep: {type: messages, value: 20}}",
     "summarization.keep: keep messages>=20 is not below trigger messages>=20"),
    ("summarization: {trigger: {type: tokens, value: 4000}, keep: [tokens, 9000]}",
     "summarization.keep: keep tokens>=9000 is not below trigger tokens>=4000"),
    ("summarization: {keep: {type: fraction, value: 30}}",
     "summarization.keep.value: a fraction must be in (0, 1]"),
    ("summarization: {trim_tokens_to_summarize: 1.5}",
     "summarization.trim_tokens_to_summarize: must be an integer"),
    ("summarization: {render: html}", "summarization.render: must be one of"),
    ("summarization: {enabled: 'yes'}", "summarization.enabled: must be true or false"),
    ("summarization: {prune: {head_chars: 6000, tail_chars: 3000}}",
     "summarization.prune: head_chars + tail_chars + the 39-character marker (9039) must be "
     "below threshold_chars (8192)"),
    ("summarization: {model_name: mini}", "summarization.model_name: 'mini' is not in models"),
    ("models: [{name: a, provider: openai, timeout_s: .nan}]",
     "models[0].timeout_s: must be a finite number"),
    ("models: [{name: a, provider: gemini}]", "models[0].provider:"),
    ("models: [{name: a, provider: openai, colour: red}]", "models[0].colour: unknown key"),
    ("models: [{name: a, provider: openai}, {name: a, provider: anthropic}]",
     "models[1].name: duplicate model name 'a'"),
    ("models: [{name: a, provider: openai, context_window: 0}]",
     "models[0].context_window: must be greater than 0"),
    ("default_model: b\nmodels: [{name: a, provider: openai}]", "default_model: 'b' is not in"),
    ("worker: {deadline_s: 400, task_time_limit_s: 300}",
     "worker: deadline_s must be below task_time_limit_s"),
    ("worker: {loop_guard: {margin: 1.5}}", "worker.loop_guard.margin: must be less"),
    ("worker: {gc_threshold: -1}", "worker.gc_threshold: must be greater than or equal"),
    ("worker: {breaker: {failures: 0}}", "worker.breaker.failures: must be greater than 0"),
    ("worker: {breaker: {failures: 2.5}}", "worker.breaker.failures: must be a valid int"),
    ("worker: {breaker: {cooldown_s: 0}}",
     "worker.breaker.cooldown_s: must be greater than 0"),
    ("worker: {breaker: {cooldown_s: .inf}}",
     "worker.breaker.cooldown_s: must be a finite"),
    ("worker: {breaker: {probes: 1}}", "worker.breaker.probes: unknown key"),
    ("worker: {gc_threshold: often}", "worker.gc_threshold: must be a valid integer"),
    ("workers: {}", "workers: unknown key"),
    ("models: [{name: a, provider: openai}]\nprices: {a: {input: -1, output: 2}}",
     "prices.a.input: must be greater than or equal to 0"),
    ("models: [{name: a, provider: openai}]\nprices: {a: {input: 1, output: 2, "
     "cache_write: -0.5}}", "prices.a.cache_write: must be greater than or equal to 0"),
    ("models: [{name: a, provider: openai}]\nprices: {a: {input: '1.5', output: 2}}",
     "prices.a.input: must be a valid number"),
    ("models: [{name: a, provider: openai}]\nprices: {a: {input: 1, output: cheap}}",
     "prices.a.output: must be a valid number"),
    ("models: [{name: a, provider: openai}]\nprices: {a: {input: 1, output: .inf}}",
     "prices.a.output: must be a finite number"),
    ("models: [{name: a, provider: openai}]\nprices: {a: {input: 1}}",
     "prices.a.output: is required"),
    ("models: [{name: a, provider: openai}]\nprices: {a: {input: 1, output: 2, cached: 1}}",
     "prices.a.cached: unknown key"),
    ("models: [{name: a, provider: openai}]\nprices: {b: {input: 1, output: 2}}",
     "prices.b: no model of that name in models, so no candidate uses it (configured: a)"),
    ("models: [{name: a, provider: openai, model: gpt-x}]\nprices: {gpt-x: {input: 1, "
     "output: 2}}", "prices.gpt-x: no model of that name in models, so no candidate uses it "
     "(it is the provider's id of models entry 'a'"),
    ("prices: {local: {input: 0, output: 0}}", "prices.local: the local summarizer makes no"),
    ("prices: [1, 2]", "prices: must be a mapping of keys"),
])
def test_bad_configs_name_the_key(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg(text)
    assert str(err.value).startswith(error), str(err.value)


def test_deerflow_block_is_accepted_verbatim() -> None:
    c = cfg("""
summarization:
  enabled: true
  model_name: null
  trigger:
    - type: tokens
      value: 4000
    - type: messages
      value: 50
  keep:
    type: messages
    value: 20
  trim_tokens_to_summarize: 4000
  summary_prompt: null
  skill_file_read_tool_names: [read_file, read, view, cat]
""")
    assert c.policy.trigger == ((Clause("tokens", 4000),), (Clause("messages", 50),))
    assert c.policy.keep == Clause("messages", 20)


def test_langchain_forms_or_and_and() -> None:
    c = cfg("summarization: {trigger: [[tokens, 4000], {tokens: 3000, messages: 30}],"
            " keep: [messages, 6]}")
    assert c.policy.trigger == ((Clause("tokens", 4000),),
                                (Clause("tokens", 3000), Clause("messages", 30)))
    assert c.policy.keep == Clause("messages", 6)


def test_fraction_dropped_without_window_turns_auto_off(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    policy = cfg("summarization: {trigger: {type: fraction, value: 0.8}}").policy
    with caplog.at_level(logging.WARNING):
        resolved = policy.resolve(None)
    assert resolved.trigger == () and not resolved.auto
    assert "fraction clauses dropped" in caplog.text
    kept = cfg("summarization: {trigger: [{type: fraction, value: 0.8}, "
               "{type: tokens, value: 9000}]}").policy.resolve(None)
    assert kept.trigger == ((Clause("tokens", 9000),),)


def test_fraction_keep_falls_back_to_messages_without_window() -> None:
    policy = cfg("summarization: {keep: {type: fraction, value: 0.3}}").policy.resolve(None)
    assert policy.keep == Clause("messages", 20)


def test_policy_round_trips_through_config() -> None:
    policy = cfg("summarization: {trigger: [{tokens: 5000, messages: 40}], keep: [tokens, 900],"
                 " clear_tool_uses: {enabled: true, keep: 2}}").policy
    from compactd.worker.compaction.policy import parse_policy

    assert parse_policy(policy.to_config()) == policy


def test_embedded_default_with_nothing_set(tmp_path: Path) -> None:
    c = load_config({"COMPACTD_HOME": str(tmp_path)})
    assert c.database_url == f"sqlite+aiosqlite:///{tmp_path}/compactd.sqlite3"
    assert c.embedded_broker and c.redis_url is None
    assert c.models == () and c.policy == Policy()


def test_env_and_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models: [{name: gpt-4o, provider: openai, context_window: 128000}]\n")
    c = load_config({"COMPACTD_DATABASE_URL": "postgresql://u@h/db",
                     "COMPACTD_BROKER_URL": "redis://127.0.0.1:6379/0",
                     "COMPACTD_CONFIG": str(path)})
    assert c.database_url == "postgresql://u@h/db"
    assert c.redis_url == "redis://127.0.0.1:6379/0"
    assert c.context_window("gpt-4o") == 128000


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config({"COMPACTD_CONFIG": str(tmp_path / "nope.yaml")})


def test_example_config_loads_and_shows_every_key() -> None:
    example = REPO / "ops" / "compactd.example.yaml"
    c = load_config({}, path=str(example))
    assert c.models and c.policy.trigger
    text = example.read_text()
    for key in ("api_key_env", "context_window", "max_output_tokens", "timeout_s", "base_url",
                "trim_tokens_to_summarize", "summary_prompt", "skill_file_read_tool_names",
                "clear_tool_uses", "exclude_tools", "clear_tool_inputs", "clear_at_least",
                "retain_ratio", "max_summary_tokens", "lease_s", "max_rounds", "render",
                "replay_mode", "strategy", "loop_guard", "metrics_port", "sweep_interval_s",
                "body_timeout_s", "max_body_bytes", "layout", "chunk_tokens",
                "index_summary_tokens", "index_max_tokens", "breaker", "failures",
                "cooldown_s", "prices", "cached_input", "cache_write", "lead", "first_lead_s",
                "clear_thinking"):
        assert f"{key}:" in text, key
    # Every configured model has a price, every price a model.
    assert set(c.prices) == {m.name for m in c.models}


def test_the_breaker_settings_reach_its_limits() -> None:
    from compactd.worker.llm.breaker import BreakerLimits

    c = cfg("worker: {candidate_budget_s: 40, breaker: {failures: 5, cooldown_s: 7}}")
    # A probe holds a circuit as long as one candidate's call may take.
    assert BreakerLimits.from_config(c.worker) == BreakerLimits(5, 7.0, 40.0)
    assert BreakerLimits.from_config(cfg("").worker) == BreakerLimits(3, 120.0, 90.0)


@pytest.mark.parametrize(("level", "error"), [
    ("bogus", "environment.log_level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
              "got 'bogus'"),
    ("", "environment.log_level: must be one of"),
])
def test_a_log_level_logging_does_not_know_is_a_load_time_error_naming_it(
        tmp_path: Path, level: str, error: str) -> None:
    # Found at load, not as a traceback from the logging set-up of every command.
    with pytest.raises(ConfigError) as err:
        load_config({"COMPACTD_HOME": str(tmp_path), "COMPACTD_LOG_LEVEL": level})
    assert str(err.value).startswith(error), str(err.value)


def test_a_log_level_in_lower_case_is_the_level(tmp_path: Path) -> None:
    c = load_config({"COMPACTD_HOME": str(tmp_path), "COMPACTD_LOG_LEVEL": "debug"})
    assert c.log_level == "DEBUG"
