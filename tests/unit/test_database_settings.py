"""``database:`` in the YAML file: its one key, its default, and a bad value refused by path."""

from __future__ import annotations

import pytest

from compactd.storage.errors import ConfigError
from compactd.worker.settings import Settings, build_config

SETTINGS = Settings(database_url="postgresql://compactd@localhost/compactd", broker_url="memory://")


def test_the_statement_cache_is_on_unless_the_file_turns_it_off() -> None:
    assert build_config({}, settings=SETTINGS).database.statement_cache is True
    off = build_config({"database": {"statement_cache": False}}, settings=SETTINGS)
    assert off.database.statement_cache is False


@pytest.mark.parametrize(("raw", "path"), [
    ({"database": {"statement_cahce": False}}, "database.statement_cahce"),
    ({"database": {"statement_cache": "sometimes"}}, "database.statement_cache"),
    ({"database": ["statement_cache"]}, "database"),
])
def test_a_bad_database_section_is_refused_by_its_path(raw: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(raw, settings=SETTINGS)
    assert str(caught.value).startswith(path), str(caught.value)
