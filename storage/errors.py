"""The exception tree of compactd.

One root, :class:`CompactdError`. Each subclass's docstring is its default message, so a raise
site only adds what is specific to it. Storage translates driver errors into these at its boundary:
nothing outside ``storage/`` catches an SQLAlchemy, asyncpg or sqlite3 exception.
"""

from __future__ import annotations


class CompactdError(Exception):
    """compactd failed."""

    # Whether the same call may succeed if made again unchanged: the failure was the
    # database's reachability (a lost connection, a primary failing over), not the input or
    # the data.
    retryable = False

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class BadInput(CompactdError):
    """The input is not valid."""


class InvalidMessage(BadInput):
    """A message is not valid."""

    def __init__(self, reason: str, *, index: int | None = None, field: str | None = None,
                 line: int | None = None) -> None:
        self.reason = reason
        self.index = index
        self.field = field
        self.line = line
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.line is not None:
            where.append(f"line {self.line}")
        elif self.index is not None:
            where.append(f"message {self.index}")
        if self.field:
            where.append(f"field {self.field!r}")
        prefix = ", ".join(where)
        return f"{prefix}: {self.reason}" if prefix else self.reason

    def at_line(self, line: int) -> InvalidMessage:
        """The same error, located at a line of an input file."""
        return InvalidMessage(self.reason, index=self.index, field=self.field, line=line)


class CompactionRefused(BadInput):
    """The compaction was refused: the loop guard holds this session."""


class ConfigError(BadInput):
    """The configuration is not valid."""


class StorageError(CompactdError):
    """The database failed."""


class SchemaMissing(StorageError):
    """The database has no compactd schema: run `compactd migrate`."""


class DatabaseUnavailable(StorageError):
    """The database cannot be reached."""

    retryable = True


class DatabaseMissing(StorageError):
    """The database does not exist: check the database URL, or create it (createdb) before
    `compactd migrate`."""

    # Not retryable: a typo in the URL does not heal. A server that is starting up answers
    # with another SQLSTATE (57P03), which stays DatabaseUnavailable.

    def __init__(self, database: str | None = None) -> None:
        self.database = database
        named = f"the database {database!r} does not exist" if database else \
            "the database does not exist"
        super().__init__(f"{named}: check the database URL, or create it (createdb) before "
                         "`compactd migrate`")


class DatabaseFileMissing(DatabaseMissing):
    """The SQLite file a command that only reads was given is not there: a mistyped path, which
    creating an empty database would answer with nothing to read."""

    def __init__(self, path: str) -> None:
        self.database = path
        StorageError.__init__(
            self, f"the SQLite database {path} does not exist: check the database URL (a "
                  "command that only reads creates no database; one that writes, or "
                  "`compactd migrate`, does)")


class SessionNotFound(BadInput):
    """No such session."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(f"session {session_id!r} does not exist")


class IdempotencyKeyReused(BadInput):
    """The idempotency key was used for another append."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"idempotency key {key!r} was used for an append of other messages "
                         "to this session; a retry must send the same messages, a new step "
                         "a new key")


class SessionExists(BadInput):
    """The session already exists with other settings."""


class LockNotAvailable(StorageError):
    """The session row is locked by another transaction."""


class DeadlinePassed(StorageError):
    """The run's deadline passed before the database answered."""


class LeaseLost(StorageError):
    """The lease fence moved: another worker owns this session now."""


class SurfaceChanged(StorageError):
    """The surface changed since the compaction read it."""


class RecallArgumentError(BadInput, ValueError):
    """An argument of a recall operation is not valid."""

    def __init__(self, argument: str, reason: str) -> None:
        self.argument = argument
        self.reason = reason
        super().__init__(f"{argument}: {reason}")


class RecallNotFound(BadInput):
    """No such checkpoint or pruned result in this session."""

    def __init__(self, session_id: str, ref: str) -> None:
        self.session_id = session_id
        self.ref = ref
        super().__init__(f"session {session_id!r} has no checkpoint or pruned result {ref!r}")
