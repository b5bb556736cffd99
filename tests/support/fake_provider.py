"""A fake LLM provider that speaks the wire formats, for tests and benchmarks.

It answers OpenAI Chat Completions (``POST /v1/chat/completions``) and Anthropic Messages
(``POST /v1/messages``) the way the real services do (bodies, status codes, ``x-request-id`` /
``request-id``, ``retry-after``), so the code under test runs through the real SDKs over real HTTP.
Summaries are deterministic: eight short sections listing the paths, exception names and ids
found in the input, always much shorter than the input and within the request's output cap; an
index call of the recallable layout (its instruction begins with
``worker.compaction.prompt.INDEX_MARK``) gets a one-line entry instead, within its cap too.

Every request is logged (path, model, headers including the attribution header, body size, times,
what was answered) and the answers are scriptable: a queue of :class:`Behaviour` entries, each
matched by model name (and optionally API) or in order, each used ``times`` times: latency,
hanging forever, an error status (429 with Retry-After, 500, 503, 529, 401, 400
``context_length_exceeded`` / "prompt is too long"), whitespace-only text, non-shrinking text (the
input echoed), malformed JSON, tool-call-only, reasoning-only or image output, a refusal
(OpenAI's ``refusal`` field, Anthropic's ``stop_reason: "refusal"``), OpenAI's content filter
(``finish_reason: "content_filter"``; a refusal on the Anthropic API), or a summary cut
off at the output cap (``finish_reason: "length"`` / ``stop_reason: "max_tokens"``). A scripted
agent model can call named tools with given arguments, an argument taken from the last tool
result it was sent (as a model copies an id it read), and answer text quoting that result. A
behaviour can also require the request to begin with a given system prompt, tools and messages
(replay mode), and answers 400 when it does not.

A prefix cache, off unless asked for (``FakeProvider(prefix_cache=True)``, ``--prefix-cache``,
``POST /_fake/config {"prefix_cache": true}``), reports cached input tokens as the providers do:
a request's longest prefix shared with an earlier answered request of the same key (the model
plus OpenAI's ``prompt_cache_key``, else the API key), counted with compactd's own token counter
and billed in 128-token blocks past the first 1,024 (nothing below 1,024). OpenAI reports it as
``usage.prompt_tokens_details.cached_tokens``, Anthropic as ``usage.cache_read_input_tokens``
(``input_tokens`` then counts only the rest, as Anthropic's does); with the cache on,
``prompt_tokens`` / ``input_tokens`` are counted with the same counter, so cached never exceeds
input. With it off, the numbers are what they always were (a quarter of the body's bytes, and
a scripted ``cached_tokens``).

It is one aiohttp server on one event loop: hundreds of requests in flight cost a coroutine each.

In-process::

    with FakeProvider(latency_s=0.0) as fake:      # a background thread, 127.0.0.1, random port
        fake.script(Behaviour(model="m1", status=503, times=3))
        ... fake.openai_base_url, fake.anthropic_base_url ...
        fake.requests                               # list[RequestRecord]

As a process another process can be pointed at (a Celery worker, a benchmark)::

    python -m tests.support.fake_provider --port 0 --latency 1.0
    # prints {"url": "http://127.0.0.1:PORT"} on its first line, then serves until SIGTERM

Control endpoints (JSON), used by :class:`RemoteFake` with the same methods as the in-process API:
``POST /_fake/script`` ``{"behaviours": [...]}``, ``POST /_fake/reset``, ``GET /_fake/requests``
(``?bodies=1`` to include bodies), ``POST /_fake/config`` ``{"latency_s": ...,
"prefix_cache": ..., "strict_system": ...}``,
``GET /_fake/health``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import re
import signal
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from compactd.storage.tokens import MESSAGE_FRAMING_TOKENS, counter_for
from compactd.worker.compaction.prompt import INDEX_MARK

HANG_S = 3600.0
OUTPUTS = ("summary", "whitespace", "echo", "malformed", "tool_calls", "reasoning_only",
           "image", "text", "truncated", "refusal", "content_filter")
SECTIONS = ("Primary Request and Intent", "Key Technical Concepts", "Files and Code",
            "Errors and Fixes", "Pending Jobs", "Current Work", "Next Step", "Critical Context")

_PATH = re.compile(r"(?<![\w/.])(?:/?[\w.-]+/)+[\w.-]+\.[A-Za-z]\w{0,7}")
_EXC = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:Error|Exception)\b")
_TICKET = re.compile(r"\b[A-Z][A-Z0-9]{1,9}-\d{2,}\b")

# The providers' prompt caching: nothing under the first 1,024 tokens, then 128-token blocks.
CACHE_MIN_TOKENS = 1024
CACHE_BLOCK_TOKENS = 128
# Earlier requests remembered per cache key (a provider's cache forgets too).
CACHE_ENTRIES_PER_KEY = 64
# What a chat completions request carries of a message.
WIRE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")


@dataclass
class Behaviour:
    """How to answer the requests it matches.

    ``model``/``api`` select requests (None matches any), and ``contains`` those whose input
    text holds that string (one kind of call among concurrent ones: an index call, the state
    call, one chunk); ``times`` is how many it answers
    (-1: every matching request from now on). ``status`` other than 200 answers an error in the
    API's own error shape; ``code`` picks a special one (``context_length_exceeded`` is OpenAI's
    code, and becomes "prompt is too long" on the Anthropic API). ``output`` shapes a 200 answer.
    """

    model: str | None = None
    api: str | None = None
    contains: str | None = None
    status: int = 200
    code: str | None = None
    retry_after: float | str | None = None
    latency_s: float | None = None
    hang: bool = False
    output: str = "summary"
    text: str | None = None
    cached_tokens: int = 0
    times: int = 1
    # The request must begin with this (replay mode): its keys ("system", "tools", "messages")
    # are compared with the body's, "messages" as a prefix followed by at least one more
    # message. A request that does not is answered 400 ``prefix_mismatch`` and recorded so.
    expect_prefix: dict[str, Any] | None = None
    # ``output="tool_calls"``: the calls to answer, each {"name": ..., "arguments": {...}}
    # (default: one call of ``lookup`` without arguments). An argument given as
    # {"$from_result": "hits.0.checkpoint"} is read from the last tool result in the request
    # (its text as JSON, then that dotted path); missing, it is null.
    tool_calls: list[dict[str, Any]] | None = None
    # ``output="text"``: each "{quote}" in ``text`` becomes the first match of this pattern in
    # the last tool result in the request ("" when nothing matches); each "{request}" becomes
    # the request's id (fixed length), so answers of one size still differ as a model's do.
    quote: str | None = None
    # Record the body of the requests it answers, whether or not the fake keeps bodies (the
    # few summary calls among an agent's many large requests).
    keep_body: bool = False

    def __post_init__(self) -> None:
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(OUTPUTS)}")

    def matches(self, model: str | None, api: str, text: str = "") -> bool:
        return ((self.model is None or self.model == model) and (self.api in (None, api))
                and (self.contains is None or self.contains in text))

    def describe(self) -> str:
        if self.hang:
            return "hang"
        if self.status != 200:
            return f"status {self.status}" + (f" {self.code}" if self.code else "")
        return self.output

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Behaviour:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


@dataclass
class RequestRecord:
    n: int
    api: str
    path: str
    model: str | None
    headers: dict[str, str]
    body_bytes: int
    max_tokens: int | None
    received_at: float          # wall clock
    received_t: float           # seconds since the server started (monotonic)
    behaviour: str
    status: int | None = None   # None until answered (or forever, for a hang)
    answered_t: float | None = None
    body: dict[str, Any] | None = None
    prefix_ok: bool | None = None  # whether it began with the behaviour's expect_prefix
    input_tokens: int | None = None   # as reported in the answer's usage (cached included)
    cached_tokens: int | None = None
    output_tokens: int | None = None

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def to_json(self, *, bodies: bool = False) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not bodies:
            out.pop("body")
        return out


DEFAULT = Behaviour(times=-1)


class _State:
    """Script queue and request log, shared by the server thread and the test thread."""

    def __init__(self, latency_s: float, keep_bodies: bool, prefix_cache: bool = False) -> None:
        self.lock = threading.Lock()
        self.latency_s = latency_s
        self.keep_bodies = keep_bodies
        self.cache = PrefixCache() if prefix_cache else None
        # As strict OpenAI-compatible servers (vLLM's chat templates, several hosted ones):
        # a system message anywhere but first is a 400.
        self.strict_system = False
        self.queue: list[Behaviour] = []
        self.log: list[RequestRecord] = []
        self.started = time.monotonic()

    def take(self, model: str | None, api: str, text: str = "") -> Behaviour:
        with self.lock:
            for i, behaviour in enumerate(self.queue):
                if behaviour.matches(model, api, text):
                    if behaviour.times > 0:
                        behaviour.times -= 1
                        if behaviour.times == 0:
                            del self.queue[i]
                    return behaviour
        return DEFAULT

    def record(self, record: RequestRecord) -> None:
        with self.lock:
            self.log.append(record)

    def reset(self) -> None:
        with self.lock:
            self.queue.clear()
            self.log.clear()
            if self.cache is not None:
                self.cache = PrefixCache()

    def set_prefix_cache(self, on: bool) -> None:
        with self.lock:
            if on and self.cache is None:
                self.cache = PrefixCache()
            elif not on:
                self.cache = None

    def prompt_usage(self, api: str, body: dict[str, Any], headers: Any
                     ) -> tuple[int, int] | None:
        """(input tokens, cached tokens) of an answered request, remembered for the next; None
        with the cache off."""
        with self.lock:
            cache = self.cache
        if cache is None:
            return None
        segments = request_segments(api, body)
        key = cache_key(api, body, headers)
        counter = counter_for(key[1] or None)
        with self.lock:
            return cache.lookup_and_store(key, segments, counter)


# --------------------------------------------------------------------------------------------
# the prefix cache


def input_tokens_of(raw: bytes) -> int:
    """The input tokens the fake reports for a request body when its prefix cache is off: a
    quarter of its bytes. Not compactd's tokenizer, on purpose: a runtime that reports this
    usage gives compactd a count of its own, as a real provider's is."""
    return input_tokens_of_size(len(raw))


def input_tokens_of_size(size: int) -> int:
    """What :func:`input_tokens_of` reports for a body of ``size`` bytes."""
    return math.ceil(size / 4)


def openai_request_body(model: str, messages: Sequence[Mapping[str, Any]]) -> bytes:
    """The body of a chat completions request for ``messages`` (their wire fields only), as a
    runtime would send it and the fake would count it."""
    wire = [{k: v for k, v in m.items() if k in WIRE_FIELDS and v is not None}
            for m in messages]
    return json.dumps({"model": model, "messages": wire}).encode()


def cached_blocks(shared_tokens: int) -> int:
    """Tokens billed as cached for a shared prefix: whole 128-token blocks past 1,024."""
    if shared_tokens < CACHE_MIN_TOKENS:
        return 0
    blocks = (shared_tokens - CACHE_MIN_TOKENS) // CACHE_BLOCK_TOKENS
    return CACHE_MIN_TOKENS + blocks * CACHE_BLOCK_TOKENS


def cache_key(api: str, body: dict[str, Any], headers: Any) -> tuple[str, str, str]:
    """Whose cache a request reads: per model, and per OpenAI ``prompt_cache_key`` when the
    request names one, else per API key."""
    raw_model = body.get("model")
    model = raw_model if isinstance(raw_model, str) else ""
    named = body.get("prompt_cache_key")
    if api == "openai" and isinstance(named, str) and named:
        return api, model, f"cache:{named}"
    auth = headers.get("authorization") or ""
    secret = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key") or ""
    return api, model, f"key:{secret}"


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b["text"] if isinstance(b, dict) and b.get("type") == "text"
                         and isinstance(b.get("text"), str) else _compact(b) for b in content)
    return "" if content is None else _compact(content)


def request_segments(api: str, body: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
    """The prompt in the order a provider reads it (tools, system, messages), one text per
    tool and per message; the flag marks a message (it costs framing tokens)."""
    out: list[tuple[str, bool]] = []
    for tool in body.get("tools") or ():
        out.append((_compact(tool), False))
    system = body.get("system")
    if system:
        out.append(("system\n" + _content_text(system), True))
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            out.append((_compact(message), True))
            continue
        parts = [str(message.get("role")), _content_text(message.get("content"))]
        parts += [_compact(c) for c in message.get("tool_calls") or ()]
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                parts.append(f"{key}={message[key]}")
        out.append(("\n".join(parts), True))
    return tuple(out)


class PrefixCache:
    """Earlier prompts by cache key, and token counts by segment text (counting a 150k-token
    prompt once per request would dominate a benchmark's run time)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str, str], deque[tuple[tuple[str, bool], ...]]] = {}
        self.tokens: dict[tuple[str, str], int] = {}

    def _tokens(self, text: str, message: bool, counter: Any) -> int:
        key = (counter.name, text)
        count = self.tokens.get(key)
        if count is None:
            if len(self.tokens) > 100_000:
                self.tokens.clear()
            count = self.tokens[key] = counter.count_text(text) + (
                MESSAGE_FRAMING_TOKENS if message else 0)
        return count

    def count(self, segments: tuple[tuple[str, bool], ...], counter: Any) -> list[int]:
        """Tokens of each segment, as a request's ``input_tokens`` adds them up."""
        return [self._tokens(text, message, counter) for text, message in segments]

    def lookup_and_store(self, key: tuple[str, str, str],
                         segments: tuple[tuple[str, bool], ...], counter: Any
                         ) -> tuple[int, int]:
        sizes = self.count(segments, counter)
        total = sum(sizes)
        earlier = self.entries.setdefault(key, deque(maxlen=CACHE_ENTRIES_PER_KEY))
        shared = 0
        for previous in earlier:
            shared = max(shared, _shared_tokens(segments, previous, sizes, counter))
        earlier.append(segments)
        return total, min(total, cached_blocks(shared))


def _shared_tokens(segments: tuple[tuple[str, bool], ...],
                   previous: tuple[tuple[str, bool], ...], sizes: list[int],
                   counter: Any) -> int:
    """Tokens of the longest common prefix: whole equal segments, then the common text of the
    first that differs."""
    shared = 0
    for i, (segment, other) in enumerate(zip(segments, previous, strict=False)):
        if segment == other:
            shared += sizes[i]
            continue
        text, theirs = segment[0], other[0]
        n = _common_prefix(text, theirs)
        return shared + (counter.count_text(text[:n]) if n else 0)
    return shared


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of two strings (binary search over C-speed compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------------------------
# the application


def build_app(state: _State) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    h = _Handlers(state)
    app.router.add_post("/v1/chat/completions", h.openai)
    app.router.add_post("/chat/completions", h.openai)
    app.router.add_post("/v1/messages", h.anthropic)
    app.router.add_post("/_fake/script", h.script)
    app.router.add_post("/_fake/reset", h.reset)
    app.router.add_post("/_fake/config", h.config)
    app.router.add_get("/_fake/requests", h.requests)
    app.router.add_get("/_fake/health", h.health)
    return app


class _Handlers:
    def __init__(self, state: _State) -> None:
        self.state = state

    async def openai(self, request: web.Request) -> web.StreamResponse:
        return await _model_call(self.state, request, "openai")

    async def anthropic(self, request: web.Request) -> web.StreamResponse:
        return await _model_call(self.state, request, "anthropic")

    async def script(self, request: web.Request) -> web.Response:
        return await _control_script(self.state, request)

    async def reset(self, request: web.Request) -> web.Response:
        return await _control_reset(self.state)

    async def config(self, request: web.Request) -> web.Response:
        return await _control_config(self.state, request)

    async def requests(self, request: web.Request) -> web.Response:
        return await _control_requests(self.state, request)

    async def health(self, request: web.Request) -> web.Response:
        return _json({"ok": True})


async def _model_call(state: _State, request: web.Request, api: str) -> web.StreamResponse:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    model = body.get("model") if isinstance(body.get("model"), str) else None
    behaviour = state.take(model, api, _input_text(body))
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    with state.lock:
        n = len(state.log) + 1
    record = RequestRecord(
        n=n, api=api, path=request.path, model=model,
        headers={k.lower(): v for k, v in request.headers.items()}, body_bytes=len(raw),
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        received_at=time.time(), received_t=time.monotonic() - state.started,
        behaviour=behaviour.describe(),
        body=body if state.keep_bodies or behaviour.keep_body else None)
    if behaviour.expect_prefix is not None:
        record.prefix_ok = begins_with(body, behaviour.expect_prefix)
        if not record.prefix_ok:
            behaviour = dataclasses.replace(behaviour, status=400, code="prefix_mismatch")
            record.behaviour = behaviour.describe()
    if state.strict_system and api == "openai" and late_system_message(body):
        behaviour = dataclasses.replace(behaviour, status=400, code="system_message_not_first")
        record.behaviour = behaviour.describe()
    state.record(record)
    latency = state.latency_s if behaviour.latency_s is None else behaviour.latency_s
    if behaviour.hang:
        await asyncio.sleep(HANG_S)
    elif latency > 0:
        await asyncio.sleep(latency)
    usage = (state.prompt_usage(api, body, request.headers)
             if behaviour.status == 200 else None)
    response = _answer(api, behaviour, body, raw, model, n, usage, record)
    record.status = response.status
    record.answered_t = time.monotonic() - state.started
    return response


def _answer(api: str, behaviour: Behaviour, body: dict[str, Any], raw: bytes,
            model: str | None, n: int, usage: tuple[int, int] | None = None,
            record: RequestRecord | None = None) -> web.Response:
    request_id = f"req_fake_{n:06d}"
    id_header = {"x-request-id" if api == "openai" else "request-id": request_id}
    if behaviour.status != 200:
        headers = dict(id_header)
        if behaviour.retry_after is not None:
            headers["retry-after"] = str(behaviour.retry_after)
        return _json(_error_body(api, behaviour.status, behaviour.code, request_id),
                     status=behaviour.status, headers=headers)
    if behaviour.output == "malformed":
        return web.Response(status=200, body=b'{"id": "broken", "choices": [', headers={
            **id_header, "content-type": "application/json"})
    text_in = _input_text(body)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 4096
    if behaviour.output == "whitespace":
        text = "   \n\t \n"
    elif behaviour.output == "echo":
        text = text_in
    elif behaviour.output == "text":
        text = (behaviour.text or "").replace("{request}", request_id)
        if behaviour.quote is not None:
            found = re.search(behaviour.quote, last_tool_result(api, body))
            text = text.replace("{quote}", found.group(0) if found else "")
    elif INDEX_MARK in text_in:
        text = fake_index_entry(text_in, model=model or "?", max_tokens=int(max_tokens))
    else:
        text = fake_summary(text_in, model=model or "?", max_tokens=int(max_tokens))
    # A real model stops where its output cap is, mid-section, and says so.
    cut = behaviour.output == "truncated"
    if cut:
        text = text[:len(text) // 2]
    usage_in, cached = usage if usage is not None else (input_tokens_of(raw), 0)
    if behaviour.cached_tokens:
        cached = behaviour.cached_tokens
    usage_out = math.ceil(len(text) / 4)
    if record is not None:
        record.input_tokens, record.cached_tokens = usage_in, cached
        record.output_tokens = usage_out
    if api == "openai":
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        finish = "length" if cut else "stop"
        if behaviour.output == "tool_calls":
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_fake_{n}_{i}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}
                for i, (name, arguments) in enumerate(_scripted_calls(api, behaviour, body))]}
            finish = "tool_calls"
        elif behaviour.output == "reasoning_only":
            message = {"role": "assistant", "content": "", "reasoning_content": "thinking..."}
        elif behaviour.output == "image":
            message = {"role": "assistant", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
        elif behaviour.output == "refusal":
            message = {"role": "assistant", "content": None,
                       "refusal": "I can't help with that request."}
        elif behaviour.output == "content_filter":
            message = {"role": "assistant", "content": ""}
            finish = "content_filter"
        payload: dict[str, Any] = {
            "id": f"chatcmpl-fake-{n}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message,
                                         "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out,
                      "total_tokens": usage_in + usage_out,
                      "prompt_tokens_details": {"cached_tokens": cached}}}
    else:
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        stop = "max_tokens" if cut else "end_turn"
        if behaviour.output == "tool_calls":
            content = [{"type": "tool_use", "id": f"toolu_fake_{n}_{i}", "name": name,
                        "input": arguments}
                       for i, (name, arguments) in enumerate(
                           _scripted_calls(api, behaviour, body))]
            stop = "tool_use"
        elif behaviour.output == "reasoning_only":
            content = [{"type": "thinking", "thinking": "thinking...", "signature": "sig"}]
        elif behaviour.output == "image":
            content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                    "data": "AAAA"}}]
        elif behaviour.output in ("refusal", "content_filter"):
            content = []
            stop = "refusal"
        payload = {"id": f"msg_fake_{n}", "type": "message", "role": "assistant",
                   "model": model, "content": content, "stop_reason": stop,
                   "stop_sequence": None,
                   "usage": {"input_tokens": usage_in - cached,
                             "output_tokens": usage_out,
                             "cache_read_input_tokens": cached,
                             "cache_creation_input_tokens": 0}}
    return _json(payload, headers=id_header)


_OPENAI_ERRORS = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("permission_denied", None, "You are not allowed to use this model."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    429: ("rate_limit_exceeded", "rate_limit_exceeded", "Rate limit reached."),
}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


def _error_body(api: str, status: int, code: str | None, request_id: str) -> dict[str, Any]:
    if api == "openai":
        etype, default_code, message = _OPENAI_ERRORS.get(
            status, ("server_error", None, "The server had an error processing your request."))
        if code == "context_length_exceeded":
            message = ("This model's maximum context length is 128000 tokens. However, your "
                       "messages resulted in 210000 tokens.")
        return {"error": {"message": message, "type": etype, "param": None,
                          "code": code or default_code}}
    etype = _ANTHROPIC_TYPES.get(status, "api_error")
    message = {"overloaded_error": "Overloaded"}.get(etype, f"fake error {status}")
    if code == "context_length_exceeded":
        message = "prompt is too long: 210000 tokens > 200000 maximum"
    return {"type": "error", "error": {"type": etype, "message": message},
            "request_id": request_id}


def late_system_message(body: dict[str, Any]) -> bool:
    """Whether a chat request holds a system (or developer) message after its first one."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") in ("system", "developer")
        for m in messages[1:])


def begins_with(body: dict[str, Any], prefix: dict[str, Any]) -> bool:
    """Whether a request body begins with ``prefix``: equal ``system`` and ``tools`` where the
    prefix names them, and ``messages`` starting with the prefix's, with more after them."""
    for key, expected in prefix.items():
        got = body.get(key)
        if key == "messages":
            if not isinstance(got, list) or len(got) <= len(expected) or (
                    got[:len(expected)] != expected):
                return False
        elif got != expected:
            return False
    return True


def last_tool_result(api: str, body: dict[str, Any]) -> str:
    """The text of the last tool result in a request ("" when it holds none): an OpenAI
    ``tool`` message, or an Anthropic ``tool_result`` block."""
    for message in reversed(body.get("messages") or ()):
        if not isinstance(message, dict):
            continue
        if api == "openai" and message.get("role") == "tool":
            return _content_text(message.get("content"))
        if api == "anthropic" and isinstance(message.get("content"), list):
            results = [b for b in message["content"]
                       if isinstance(b, dict) and b.get("type") == "tool_result"]
            if results:
                return _content_text(results[-1].get("content"))
    return ""


def _scripted_calls(api: str, behaviour: Behaviour, body: dict[str, Any]
                    ) -> list[tuple[str, dict[str, Any]]]:
    if behaviour.tool_calls is None:
        return [("lookup", {})]
    result: Any = None
    calls = []
    for call in behaviour.tool_calls:
        arguments = {}
        for key, value in (call.get("arguments") or {}).items():
            if isinstance(value, dict) and set(value) == {"$from_result"}:
                if result is None:
                    result = _json_or_none(last_tool_result(api, body))
                value = _dotted(result, value["$from_result"])
            arguments[key] = value
        calls.append((str(call["name"]), arguments))
    return calls


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dotted(value: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def _input_text(body: dict[str, Any]) -> str:
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        parts.append(system)
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return "\n\n".join(parts)


def fake_summary(text: str, *, model: str, max_tokens: int) -> str:
    """Eight short sections naming what the input mentions; at most a quarter of its length."""
    def listed(pattern: re.Pattern[str], limit: int) -> str:
        found = list(dict.fromkeys(pattern.findall(text)))[:limit]
        return ", ".join(found) if found else "(none)"

    bodies = {
        "Primary Request and Intent": f"- summarize {len(text)} characters of conversation",
        "Files and Code": f"- {listed(_PATH, 12)}",
        "Errors and Fixes": f"- {listed(_EXC, 8)}",
        "Current Work": f"- summarized by {model}",
        "Critical Context": f"- {listed(_TICKET, 8)}",
    }
    out = "\n".join(f"## {name}\n{bodies.get(name, '(none)')}" for name in SECTIONS)
    limit = min(len(text) // 4, max_tokens * 3)
    if len(out) > limit or _over_cap(out, max_tokens):
        # A shorter summary still has every section, as a real one would.
        short = {"Current Work": bodies["Current Work"]}
        out = "\n".join(f"## {name}\n{short.get(name, '(none)')}" for name in SECTIONS)
    return _within_cap(out if len(out) <= limit else out[:max(1, limit)], max_tokens)


def fake_index_entry(text: str, *, model: str, max_tokens: int) -> str:
    """One line for an index call: what the chunk mentions, within its output cap."""
    def listed(pattern: re.Pattern[str], limit: int) -> str:
        found = list(dict.fromkeys(pattern.findall(text)))[:limit]
        return ", ".join(found) if found else "none"

    entry = (f"{model} indexed {len(text)} characters; files {listed(_PATH, 3)}; errors "
             f"{listed(_EXC, 3)}; ids {listed(_TICKET, 3)}.")
    return _within_cap(entry, max_tokens)


# The fake does not know the run model's encoding: it keeps under the cap with a margin.
_CAP_MARGIN = 0.9


def _over_cap(text: str, max_tokens: int) -> bool:
    return counter_for(None).count_text(text) > int(max_tokens * _CAP_MARGIN)


def _within_cap(text: str, max_tokens: int) -> str:
    """``text`` cut (on code points) to what the output cap allows, as a model stops there."""
    while len(text) > 1 and _over_cap(text, max_tokens):
        text = text[:max(1, int(len(text) * 0.9))]
    return text


def _json(payload: Any, *, status: int = 200, headers: dict[str, str] | None = None
          ) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload),
                        content_type="application/json", headers=headers)


async def _control_script(state: _State, request: web.Request) -> web.Response:
    data = await request.json()
    behaviours = [Behaviour.from_json(b) for b in data.get("behaviours", ())]
    with state.lock:
        state.queue.extend(behaviours)
    return _json({"queued": len(behaviours)})


async def _control_reset(state: _State) -> web.Response:
    state.reset()
    return _json({"ok": True})


async def _control_config(state: _State, request: web.Request) -> web.Response:
    data = await request.json()
    if "latency_s" in data:
        state.latency_s = float(data["latency_s"])
    if "prefix_cache" in data:
        state.set_prefix_cache(bool(data["prefix_cache"]))
    if "strict_system" in data:
        state.strict_system = bool(data["strict_system"])
    return _json({"latency_s": state.latency_s, "prefix_cache": state.cache is not None,
                  "strict_system": state.strict_system})


async def _control_requests(state: _State, request: web.Request) -> web.Response:
    bodies = request.query.get("bodies") in ("1", "true")
    with state.lock:
        records = [r.to_json(bodies=bodies) for r in state.log]
    return _json({"requests": records})


# --------------------------------------------------------------------------------------------
# running it


class FakeProvider:
    """The fake, served from a background thread with its own event loop."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, latency_s: float = 0.0,
                 keep_bodies: bool = True, prefix_cache: bool = False) -> None:
        self.host = host
        self.port = port
        self._state = _State(latency_s, keep_bodies, prefix_cache)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # lifecycle

    def start(self) -> FakeProvider:
        self._thread = threading.Thread(target=self._serve, name="fake-provider", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError("the fake provider did not start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start(), which is waiting
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = await serve(self._state, self.host, self.port)
        self.port = runner_port(runner)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    # addresses

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.url

    # scripting and the log

    @property
    def latency_s(self) -> float:
        return self._state.latency_s

    @latency_s.setter
    def latency_s(self, value: float) -> None:
        self._state.latency_s = value

    @property
    def prefix_cache(self) -> bool:
        return self._state.cache is not None

    @prefix_cache.setter
    def prefix_cache(self, on: bool) -> None:
        self._state.set_prefix_cache(on)

    @property
    def strict_system(self) -> bool:
        """Refuse (400) a chat request with a system message anywhere but first."""
        return self._state.strict_system

    @strict_system.setter
    def strict_system(self, on: bool) -> None:
        self._state.strict_system = on

    def script(self, *behaviours: Behaviour, **one: Any) -> None:
        """Queue behaviours (or one built from keyword arguments)."""
        queued = list(behaviours) + ([Behaviour(**one)] if one else [])
        with self._state.lock:
            self._state.queue.extend(queued)

    @property
    def requests(self) -> list[RequestRecord]:
        with self._state.lock:
            return list(self._state.log)

    def requests_for(self, model: str | None = None, api: str | None = None
                     ) -> list[RequestRecord]:
        return [r for r in self.requests
                if (model is None or r.model == model) and (api is None or r.api == api)]

    def pending_script(self) -> list[Behaviour]:
        with self._state.lock:
            return list(self._state.queue)

    def reset(self) -> None:
        self._state.reset()


async def serve(state: _State, host: str, port: int) -> web.AppRunner:
    # handler_cancellation: a client that gives up (a cancelled hang) frees its handler at once.
    runner = web.AppRunner(build_app(state), access_log=None, handler_cancellation=True,
                           shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    return runner


def runner_port(runner: web.AppRunner) -> int:
    address = runner.addresses[0]
    return int(address[1])


class RemoteFake:
    """The control API of a fake provider running in another process."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.url

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as response:
            return json.loads(response.read())

    def health(self) -> bool:
        return bool(self._call("GET", "/_fake/health").get("ok"))

    def script(self, *behaviours: Behaviour, **one: Any) -> None:
        queued = list(behaviours) + ([Behaviour(**one)] if one else [])
        self._call("POST", "/_fake/script",
                   {"behaviours": [dataclasses.asdict(b) for b in queued]})

    def configure(self, *, latency_s: float | None = None,
                  prefix_cache: bool | None = None) -> None:
        settings: dict[str, Any] = {}
        if latency_s is not None:
            settings["latency_s"] = latency_s
        if prefix_cache is not None:
            settings["prefix_cache"] = prefix_cache
        self._call("POST", "/_fake/config", settings)

    def requests(self, *, bodies: bool = False) -> list[dict[str, Any]]:
        path = "/_fake/requests" + ("?bodies=1" if bodies else "")
        return list(self._call("GET", path)["requests"])

    def reset(self) -> None:
        self._call("POST", "/_fake/reset", {})


@contextlib.contextmanager
def fake_provider_process(latency_s: float = 0.0, *, prefix_cache: bool = False,
                          keep_bodies: bool = False) -> Iterator[str]:
    """A fake provider in a subprocess, so a benchmark's measurements do not share its CPU; its
    URL (drive it with :class:`RemoteFake`). Stopped on exit."""
    import subprocess
    from pathlib import Path

    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fake_provider", "--port", "0",
         "--latency", str(latency_s), *(["--prefix-cache"] if prefix_cache else []),
         *(["--keep-bodies"] if keep_bodies else [])],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the fake provider did not start")
        yield json.loads(line)["url"]
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def summaries_of(records: Iterable[RequestRecord]) -> Iterator[str]:
    """The behaviours the fake applied, for compact assertions."""
    for record in records:
        yield f"{record.model}:{record.behaviour}:{record.status}"


# --------------------------------------------------------------------------------------------


async def _run_cli(host: str, port: int, latency_s: float, keep_bodies: bool,
                   prefix_cache: bool) -> None:
    state = _State(latency_s, keep_bodies, prefix_cache)
    runner = await serve(state, host, port)
    print(json.dumps({"url": f"http://{host}:{runner_port(runner)}"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fake_provider",
                                     description="A fake OpenAI/Anthropic provider.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per answer")
    parser.add_argument("--keep-bodies", action="store_true",
                        help="keep request bodies in the log (memory grows with traffic)")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="report cached input tokens as the providers' prefix caches do")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run_cli(args.host, args.port, args.latency, args.keep_bodies,
                             args.prefix_cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
