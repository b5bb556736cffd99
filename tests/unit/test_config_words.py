"""A config key refused at load reads in compactd's words: the key's path and what it must be,
never pydantic's ("Input should be", "Field required", a class name)."""

from __future__ import annotations

from typing import Any

import pytest

from compactd.storage.errors import ConfigError
from compactd.worker.settings import Settings, build_config

SETTINGS = Settings(database_url="sqlite:///x.sqlite3", broker_url="memory://")


@pytest.mark.parametrize(("raw", "said"), [
    ({"prices": {"gpt-x": 3}}, "prices.gpt-x: must be a mapping of keys, got 3"),
    ({"prices": {"gpt-x": {"input": "cheap", "output": 1}}},
     "prices.gpt-x.input: must be a valid number"),
    ({"prices": {"gpt-x": {"output": 1}}}, "prices.gpt-x.input: is required"),
    ({"prices": {"gpt-x": {"input": -1, "output": 1}}},
     "prices.gpt-x.input: must be greater than or equal to 0"),
    ({"events": 3}, "events: must be a mapping of keys, got 3"),
    ({"worker": {"deadline_s": "soon"}}, "worker.deadline_s: must be a valid number"),
    # The keys tests/acceptance/test_config_effects.py shows acting.
    ({"worker": {"max_attempts": 0}}, "worker.max_attempts: must be greater than 0"),
    ({"worker": {"max_attempts": "twice"}},
     "worker.max_attempts: must be a valid integer"),
    ({"worker": {"retry_after_cap_s": -1}},
     "worker.retry_after_cap_s: must be greater than or equal to 0"),
    ({"worker": {"provider_rate_per_s": 0}},
     "worker.provider_rate_per_s: must be greater than 0"),
    ({"worker": {"provider_rate_per_s": "20/s"}},
     "worker.provider_rate_per_s: must be a valid number"),
    ({"worker": {"provider_rate": 20}}, "worker.provider_rate: unknown key"),
    ({"summarization": {"max_rounds": 0}}, "summarization.max_rounds: must be positive, got 0"),
    ({"summarization": {"max_rounds": 1.5}},
     "summarization.max_rounds: must be an integer, got 1.5"),
    ({"summarization": {"skills_path": ""}},
     "summarization.skills_path: must be a non-empty string, got ''"),
    ({"summarization": {"skill_file_read_tool_names": "read_file"}},
     "summarization.skill_file_read_tool_names: must be a list of strings, got 'read_file'"),
    ({"summarization": {"skill_file_read_tool_names": ["read_file", 3]}},
     "summarization.skill_file_read_tool_names[1]: must be a non-empty string, got 3"),
])
def test_a_bad_key_is_named_with_what_it_must_be(raw: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(raw, settings=SETTINGS)
    assert str(caught.value) == said
