"""A failed run's end is written again while the database is unavailable (a primary failing
over), until the run's grace ends: the lease is released on the new primary instead of
expiring. Other errors are not retried."""

from __future__ import annotations

import asyncio

import pytest

from compactd.storage.errors import DatabaseUnavailable, StorageError
from compactd.worker.run import _while_unavailable


class Flaky:
    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return True


async def test_written_once_the_database_answers_again() -> None:
    call = Flaky(2, DatabaseUnavailable())
    until = asyncio.get_running_loop().time() + 5
    assert await _while_unavailable(call, until=until) is True
    assert call.calls == 3


async def test_gives_up_at_the_end_of_the_grace() -> None:
    call = Flaky(1000, DatabaseUnavailable())
    until = asyncio.get_running_loop().time() + 0.6
    with pytest.raises(DatabaseUnavailable):
        await _while_unavailable(call, until=until)
    assert 1 < call.calls < 10


async def test_a_data_error_is_not_retried() -> None:
    call = Flaky(1, StorageError("database error: UniqueViolationError"))
    with pytest.raises(StorageError):
        await _while_unavailable(call, until=asyncio.get_running_loop().time() + 5)
    assert call.calls == 1
