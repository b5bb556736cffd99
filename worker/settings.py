"""Configuration: one object, built where a process starts, plain values passed inward.

Environment (prefix ``COMPACTD_``): ``DATABASE_URL``, ``BROKER_URL``, ``CONFIG`` (a YAML file),
``HOME`` (where the embedded default keeps its files), ``LOG_FORMAT``, ``METRICS_PORT`` (overrides
``worker.metrics_port``). The YAML file holds the rest: ``models:``, ``summarization:`` (see
``worker.compaction.policy``), ``worker:``, ``api:`` (the HTTP API of ``compactd serve``),
``prices:`` (USD per million tokens of each configured model, see ``worker.cost``),
``retention:``, ``database:`` (how the connections are used, e.g. behind PgBouncer).
With nothing set, everything runs on the embedded default: a SQLite file, a broker that needs no
server (kombu's filesystem transport under COMPACTD_HOME), and the local model-free summarizer.

Every load-time error is a :class:`ConfigError` whose message starts with the key path.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from compactd.storage.database import embedded_url
from compactd.storage.errors import ConfigError
from compactd.storage.events import EventKind
from compactd.storage.ids import ID_PATTERN, MAX_INT32
from compactd.storage.records import APPEND_KEY_WINDOW_S
from compactd.worker.compaction.lead import (
    FIRST_LEAD_S,
    FLEET_LEAD_KEYS,
    parse_first_lead,
    parse_lead,
    parse_lead_steps,
)
from compactd.worker.compaction.policy import (
    Policy,
    PolicyError,
    check_keep_below_trigger,
    parse_policy,
)
from compactd.worker.cost import Price

LOCAL_MODEL = "local"


class _Strict(BaseModel):
    # allow_inf_nan=False: YAML's .nan and .inf parse as floats, and a non-finite limit never
    # compares the way anyone meant.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """One entry of ``models:``."""

    name: str = Field(min_length=1)
    provider: Literal["openai", "anthropic", "openai-compatible", "local"]
    model: str | None = None  # the provider's model id; defaults to ``name``
    base_url: str | None = None
    api_key_env: str | None = None
    # Sessions store it in an INTEGER column.
    context_window: int | None = Field(default=None, gt=0, le=MAX_INT32)
    max_output_tokens: int | None = Field(default=None, gt=0)
    timeout_s: float = Field(default=60.0, gt=0)

    @property
    def model_id(self) -> str:
        return self.model or self.name


# A price is a number as written: strict, so a quoted "2.50" or a yes is refused, not coerced.
_USD_PER_MILLION = Field(ge=0, strict=True)


class PriceSpec(_Strict):
    """One entry of ``prices:``: USD per million tokens. ``cached_input`` (read from the
    prompt cache) and ``cache_write`` (written to it, which Anthropic bills apart) default to
    ``input``: no discount and no surcharge unless the provider's list says so."""

    input: float = _USD_PER_MILLION
    output: float = _USD_PER_MILLION
    cached_input: float | None = Field(default=None, ge=0, strict=True)
    cache_write: float | None = Field(default=None, ge=0, strict=True)

    def price(self) -> Price:
        return Price(input=self.input, output=self.output,
                     cached_input=self.input if self.cached_input is None else self.cached_input,
                     cache_write=self.input if self.cache_write is None else self.cache_write)


class LoopGuardConfig(_Strict):
    """A session compacted more than ``max_compactions`` times within ``window_s`` without its
    pressure falling ``margin`` below the trigger is cooled down for ``cooldown_s`` and flagged."""

    max_compactions: int = Field(default=3, gt=0)
    window_s: float = Field(default=600.0, gt=0)
    margin: float = Field(default=0.1, ge=0, lt=1)
    cooldown_s: float = Field(default=900.0, gt=0)


class BreakerConfig(_Strict):
    """A summary candidate whose calls failed ``failures`` times in a row (timeouts, connection
    and server errors, a hang ended by the deadline) is skipped by every run of every worker for
    ``cooldown_s``; then one run's call probes it, and its answer closes the circuit again."""

    failures: int = Field(default=3, gt=0)
    cooldown_s: float = Field(default=120.0, gt=0)


class WorkerConfig(_Strict):
    concurrency: int = Field(default=64, gt=0)
    # PostgreSQL connections each worker process keeps open, and never more: connections are
    # held only for short transactions, never across a model call, so 20 serve 64 compactions
    # in flight. A pool that opened extra connections under load and closed them on return
    # would pay each connect again (TLS probe, type introspection, statements prepared again)
    # and a server process fork each time. Workers x this
    # stays under the server's max_connections (100 by default).
    db_pool_size: int = Field(default=20, gt=0)
    # The garbage collector's first-generation threshold in a worker process (see
    # worker.runtime.tune_gc); 0 keeps Python's own (700).
    gc_threshold: int = Field(default=10_000, ge=0)
    # The event loop of a worker process (see worker.runtime.new_worker_loop): auto is uvloop
    # when it is installed (it is a dependency except on Windows), else asyncio's own.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    deadline_s: float = Field(default=240.0, gt=0)
    task_time_limit_s: float = Field(default=300.0, gt=0)
    candidate_budget_s: float = Field(default=90.0, gt=0)
    max_attempts: int = Field(default=4, gt=0)
    retry_after_cap_s: float = Field(default=20.0, ge=0)
    lease_s: float = Field(default=60.0, gt=0)
    sweep_interval_s: float = Field(default=30.0, gt=0)
    reap_interval_s: float = Field(default=15.0, gt=0)
    sweep_batch: int = Field(default=200, gt=0)
    signal_ttl_s: float = Field(default=120.0, gt=0)
    unavailable_model_s: float = Field(default=300.0, gt=0)
    local_fallback: bool = True
    # Index the text of what a run replaced right after the run (and in the beat sweep), for
    # history_search. Off, the commits still record what they replaced (history_read serves it)
    # but only the newest replaced originals are found, by a scan; the benchmarks turn it off to
    # measure what the index costs.
    recall_index: bool = True
    attribution_header: str = "x-compactd-purpose"
    attribution_value: str = "compaction"
    metrics_port: int = Field(default=9540, ge=0, le=65535)
    provider_rate_per_s: float | None = Field(default=None, gt=0)
    loop_guard: LoopGuardConfig = LoopGuardConfig()
    breaker: BreakerConfig = BreakerConfig()

    @model_validator(mode="after")
    def _deadline_below_limit(self) -> WorkerConfig:
        # The fallback's overall deadline must end before Celery kills the task, or a slow
        # provider turns a clean `summary` failure into a killed task and an abandoned lease.
        if self.deadline_s >= self.task_time_limit_s:
            raise ValueError("deadline_s must be below task_time_limit_s")
        return self


class ApiToken(_Strict):
    """One bearer token of ``api.tokens`` and the tenant it acts for.

    The secret itself never sits in the file: either the name of an environment variable that
    holds it (read when the server starts), or its SHA-256 hex digest.
    """

    # The rule every door applies to tenant names (storage.ids), as a pattern.
    tenant: str = Field(min_length=1, max_length=255, pattern=ID_PATTERN)
    token_env: str | None = Field(default=None, min_length=1)
    token_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _one_source(self) -> ApiToken:
        if (self.token_env is None) == (self.token_sha256 is None):
            raise ValueError("give exactly one of token_env and token_sha256")
        return self


class ApiConfig(_Strict):
    """``compactd serve``: who may call it, and how much it accepts."""

    tokens: tuple[ApiToken, ...] = ()
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # A request that waits for a compaction holds a connection; this caps what a caller may ask.
    max_wait_s: float = Field(default=120.0, gt=0)
    # A body must arrive whole within this (408 after it): a client that announces more than it
    # sends would otherwise hold its connection and its request for ever.
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # Swagger UI and ReDoc load their JavaScript from a CDN: a browser that opens them runs code
    # the server does not ship. Off unless asked for; /openapi.json is always served.
    docs: bool = False
    # Append bodies over 32 KiB are decoded and counted in this many worker processes of the
    # server (PostgreSQL), so a 4 MB append does not hold the event loop other tenants share;
    # large appends beyond this many wait their turn. 0: on one thread of the server process.
    cpu_processes: int = Field(default=1, ge=0, le=64)


_DAYS = Field(default=None, gt=0, strict=True)


class RetentionConfig(_Strict):
    """``retention:``, what the beat's purge deletes (unset: kept for ever). ``originals_days``:
    the recall index's originals (the text of what compaction replaced, kept searchable) of
    messages appended longer ago; ``sessions_idle_days``: whole sessions with no append for
    that long, with everything of them (as ``compactd delete``); ``append_keys_hours``: how
    long an append's idempotency key holds (always set: older keys are purged).
    ``interval_s``: how often the purge runs."""

    originals_days: float | None = _DAYS
    sessions_idle_days: float | None = _DAYS
    interval_s: float = Field(default=3600.0, gt=0, strict=True)
    # How long an append's idempotency key answers for the append made with it (a retry after
    # that stores the step again); the purge deletes older keys. Up to 30 days.
    append_keys_hours: float = Field(default=APPEND_KEY_WINDOW_S / 3600, gt=0, le=720,
                                     strict=True)

    @property
    def append_key_window_s(self) -> float:
        return self.append_keys_hours * 3600


class DatabaseConfig(_Strict):
    """``database:``, how compactd's processes use their PostgreSQL connections."""

    # asyncpg prepares each statement once per connection and reuses it by name. Behind
    # PgBouncer in transaction (or statement) pooling mode before 1.21 a connection's
    # statements run on whichever server connection is free, where that name is unknown (or
    # another client's): false sends every statement unnamed, parsed with its execution.
    # Needed there, and costs a parse per statement anywhere else. SQLite ignores it.
    statement_cache: bool = True


# An entry point: a dotted module, a colon, a dotted attribute path.
HOOK_PATTERN = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"


class WebhookSpec(_Strict):
    """One entry of ``events.webhooks``: where to POST the events, the secret that signs them
    (HMAC-SHA256, :mod:`worker.webhooks`) and which kinds it wants (all when unset)."""

    url: str
    secret: str = Field(min_length=1)
    events: tuple[EventKind, ...] | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an http:// or https:// URL with a host, not {url!r}")
        return url

    def wants(self, kind: str) -> bool:
        return self.events is None or kind in self.events


class EventsConfig(_Strict):
    """``events:``, who hears of compactd's events besides PostgreSQL's listeners. A delivery
    that fails (no answer, an answer other than 2xx) is tried again ``retries`` times, the
    first after ``backoff_s`` and each wait doubling (up to 5 minutes), jittered down to half;
    then it is counted as dead-lettered."""

    webhooks: tuple[WebhookSpec, ...] = ()
    retries: int = Field(default=8, ge=0, le=100)
    backoff_s: float = Field(default=2.0, gt=0)
    # ``module:function`` the worker calls before each run (worker.hooks), and how long it may
    # take (never more than a quarter of what is left of the run's deadline: worker.hooks).
    pre_compaction: str | None = None
    hook_timeout_s: float = Field(default=5.0, gt=0)

    @field_validator("pre_compaction")
    @classmethod
    def _entry_point(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(HOOK_PATTERN, value):
            raise ValueError(f"a Python entry point module:function, not {value!r}")
        return value


class FileConfig(_Strict):
    models: tuple[ModelSpec, ...] = ()
    default_model: str | None = None
    worker: WorkerConfig = WorkerConfig()
    api: ApiConfig = ApiConfig()
    prices: dict[str, PriceSpec] = Field(default_factory=dict)
    retention: RetentionConfig = RetentionConfig()
    database: DatabaseConfig = DatabaseConfig()
    events: EventsConfig = EventsConfig()


# The levels logging knows by name, and its aliases of two of them.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LOG_LEVEL_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}


class Settings(BaseSettings):
    """What the environment says; ``load_settings`` adds the YAML file."""

    model_config = SettingsConfigDict(env_prefix="COMPACTD_", extra="ignore")

    database_url: str | None = None
    broker_url: str | None = None
    redis_url: str | None = None
    config: str | None = None
    home: str | None = None
    log_format: Literal["auto", "json", "text"] = "auto"
    log_level: str = "INFO"
    # Overrides worker.metrics_port: several workers on one host (systemd's worker@) share the
    # YAML file but each needs its own port.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        # Checked here: logging would refuse it only when each process sets its logging up,
        # with a traceback.
        level = value.strip().upper()
        level = _LOG_LEVEL_ALIASES.get(level, level)
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
        return level


@dataclass(frozen=True)
class Config:
    """Everything a process needs, resolved."""

    database_url: str
    broker_url: str
    redis_url: str | None
    home: Path
    models: tuple[ModelSpec, ...] = ()
    default_model: str | None = None
    policy: Policy = field(default_factory=Policy)
    # ``summarization.lead``: None measures it (auto), else the seconds a growing session fires
    # early by (0: at its trigger). Fleet-wide, not a session's: ``worker.lead``.
    lead: float | None = None
    # ``summarization.first_lead_s``: the lead of ``auto`` before any run is measured.
    first_lead_s: float = FIRST_LEAD_S
    # ``summarization.lead_steps``: the lead also counts the session's largest recent step.
    lead_steps: bool = True
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    # USD per million tokens, by configured model name (see worker.cost). Out of the hash (a
    # dict has none): a Config keys caches, and prices change no cached object.
    prices: Mapping[str, Price] = field(default_factory=dict, hash=False)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    log_format: str = "auto"
    log_level: str = "INFO"
    config_path: str | None = None

    @property
    def embedded_broker(self) -> bool:
        return self.broker_url.startswith("filesystem://")

    def model(self, name: str | None) -> ModelSpec | None:
        for spec in self.models:
            if spec.name == name:
                return spec
        return None

    def context_window(self, run_model: str | None) -> int | None:
        spec = self.model(run_model)
        return spec.context_window if spec else None


def broker_dirs(home: Path) -> dict[str, Any]:
    base = home / "compactd-broker"
    for sub in ("in", "processed", "control"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    # control_folder defaults to ./control, relative to wherever the process was started.
    return {"data_folder_in": str(base / "in"), "data_folder_out": str(base / "in"),
            "processed_folder": str(base / "processed"), "control_folder": str(base / "control"),
            "store_processed": False}


def load_config(env: Mapping[str, str] | None = None, *, path: str | None = None) -> Config:
    """Build the configuration from the environment and the optional YAML file."""
    try:
        settings = Settings(**_env_kwargs(env)) if env is not None else Settings()
    except ValidationError as exc:
        raise ConfigError(_format_pydantic(exc, "environment")) from None
    home = Path(settings.home or os.getcwd()).expanduser().resolve()
    config_path = path or settings.config
    raw: dict[str, Any] = {}
    if config_path:
        raw = read_yaml(config_path)
    return build_config(raw, settings=settings, home=home, config_path=config_path)


def read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


_FILE_KEYS = {"models", "default_model", "summarization", "worker", "api", "prices",
              "retention", "database", "events"}


def build_config(raw: Mapping[str, Any], *, settings: Settings | None = None,
                 home: Path | None = None, config_path: str | None = None) -> Config:
    settings = settings or Settings()
    home = home or Path(settings.home or os.getcwd()).expanduser().resolve()
    file_config = _file_config(raw)
    policy, lead, first_lead_s, lead_steps = _summarization(raw.get("summarization"),
                                                            file_config)
    prices = _check_prices(file_config)
    worker = file_config.worker
    if settings.metrics_port is not None:
        worker = worker.model_copy(update={"metrics_port": settings.metrics_port})
    return Config(
        database_url=settings.database_url or embedded_url(home),
        broker_url=_check_broker_url(settings.broker_url) if settings.broker_url
        else "filesystem://",
        redis_url=settings.redis_url or _redis_from_broker(settings.broker_url),
        home=home, models=file_config.models, default_model=file_config.default_model,
        policy=policy, lead=lead, first_lead_s=first_lead_s, lead_steps=lead_steps,
        worker=worker, api=file_config.api,
        prices=prices,
        retention=file_config.retention, database=file_config.database,
        events=file_config.events, log_format=settings.log_format,
        log_level=settings.log_level, config_path=config_path)


def _file_config(raw: Mapping[str, Any]) -> FileConfig:
    """Every top-level section but ``summarization``, checked: known keys, unique model names,
    a default model that is configured."""
    for key in raw:
        if key not in _FILE_KEYS:
            raise ConfigError(
                f"{key}: unknown key (expected one of {', '.join(sorted(_FILE_KEYS))})")
    try:
        file_config = FileConfig(**{k: v for k, v in raw.items() if k != "summarization"})
    except ValidationError as exc:
        raise ConfigError(_format_pydantic(exc, None)) from None
    names = [m.name for m in file_config.models]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"models[{i}].name: duplicate model name {name!r}")
    if file_config.default_model and file_config.default_model not in [*names, LOCAL_MODEL]:
        raise ConfigError(f"default_model: {file_config.default_model!r} is not in models")
    return file_config


def _summarization(summarization: Any, file_config: FileConfig
                   ) -> tuple[Policy, float | None, float, bool]:
    """The ``summarization`` section: the policy, and the lead, first lead and whether the lead
    counts steps (which the policy does not hold: they are the fleet's), checked against the
    configured models."""
    lead: float | None = None
    first_lead_s = FIRST_LEAD_S
    lead_steps = True
    try:
        if isinstance(summarization, Mapping):
            if "lead" in summarization:
                lead = parse_lead(summarization["lead"])
            if "first_lead_s" in summarization:
                first_lead_s = parse_first_lead(summarization["first_lead_s"])
            if "lead_steps" in summarization:
                lead_steps = parse_lead_steps(summarization["lead_steps"])
            summarization = {k: v for k, v in summarization.items()
                             if k not in FLEET_LEAD_KEYS}
        policy = parse_policy(summarization)
        # Sessions of a configured run model take its window: their keep is judged against
        # it now, not found re-firing the trigger in production.
        check_keep_below_trigger(policy, "summarization", [
            (f"models[{i}] ({m.name})", m.context_window)
            for i, m in enumerate(file_config.models) if m.context_window])
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    names = [m.name for m in file_config.models]
    if policy.model_name and policy.model_name not in [*names, LOCAL_MODEL]:
        raise ConfigError(f"summarization.model_name: {policy.model_name!r} is not in models")
    return policy, lead, first_lead_s, lead_steps


def _check_prices(file_config: FileConfig) -> dict[str, Price]:
    """Prices by model name. A price is for a configured model, by its ``models[].name`` (the
    name usage is recorded under): a price under any other key would never be applied, so a
    typo would silently leave that model's runs unpriced."""
    names = [m.name for m in file_config.models]
    for key in file_config.prices:
        if key == LOCAL_MODEL:
            raise ConfigError(f"prices.{key}: the local summarizer makes no provider call and "
                              "costs nothing; it takes no price")
        if key not in names:
            ids = [m.name for m in file_config.models if m.model_id == key]
            hint = (f" (it is the provider's id of models entry {ids[0]!r}: prices are keyed "
                    "by models[].name)") if ids else (
                f" (configured: {', '.join(names)})" if names else " (no models are configured)")
            raise ConfigError(f"prices.{key}: no model of that name in models, so no candidate "
                              f"uses it{hint}")
    return {name: spec.price() for name, spec in file_config.prices.items()}


def _check_broker_url(url: str) -> str:
    """Refuse a broker URL kombu cannot use when the configuration loads, not with kombu's
    traceback at the first send. The message never repeats the URL (it may hold a password)."""
    from kombu.transport import TRANSPORT_ALIASES
    from kombu.utils.url import parse_url

    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in TRANSPORT_ALIASES:
        named = f" {scheme!r}" if sep else ""
        raise ConfigError(f"COMPACTD_BROKER_URL: unknown broker transport{named} (expected "
                          "e.g. redis://host:6379/0, amqp://host//, filesystem://)")
    try:
        parse_url(url)
    except ValueError as exc:
        raise ConfigError(f"COMPACTD_BROKER_URL: {exc}") from None
    return url


def _redis_from_broker(broker_url: str | None) -> str | None:
    if broker_url and broker_url.startswith(("redis://", "rediss://")):
        return broker_url
    return None


def _env_kwargs(env: Mapping[str, str]) -> dict[str, Any]:
    prefix = "COMPACTD_"
    return {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}


def _format_pydantic(exc: ValidationError, root: str | None) -> str:
    first = exc.errors()[0]
    parts = [str(p) for p in first["loc"]]
    path = ""
    for p in parts:
        path += f"[{p}]" if p.isdigit() else (f".{p}" if path else p)
    if root:
        path = f"{root}.{path}" if path else root
    return f"{path}: {plain_problem(first)}"


_MAPPING_TYPES = frozenset({"model_type", "dict_type", "model_attributes_type"})


def plain_problem(error: Mapping[str, Any]) -> str:
    """The problem of one of pydantic's errors in the words of compactd's other refusals
    ("must be ..."), without pydantic's ("Input should be", "Field required", its class names):
    a config key, a CLI argument and an HTTP body field read the same."""
    kind, ctx = error.get("type"), error.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "is required"
    if kind in _MAPPING_TYPES:
        return f"must be a mapping of keys, got {_shown(error.get('input'))}"
    if kind in ("enum", "literal_error") and "expected" in ctx:
        return f"must be one of {ctx['expected']}, got {_shown(error.get('input'))}"
    # A validator's own ValueError reads "Value error, <its message>".
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    msg = msg.split(", unable to parse", 1)[0]
    if msg.startswith("Input should be "):
        msg = "must be " + msg.removeprefix("Input should be ")
    return msg


def _shown(value: object) -> str:
    if isinstance(value, dict | list):
        return "a mapping" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
