"""Token accounting that works offline.

tiktoken downloads its encoding files on first use, which fails on a machine without internet.
compactd ships ``o200k_base`` and ``cl100k_base`` in ``storage/data`` (the files OpenAI publishes,
checked against the sha256 tiktoken itself expects) and builds the encodings from them without any
network access and without touching ``TIKTOKEN_CACHE_DIR``.

Counters, chosen by the model that will read the messages:

* OpenAI models use their own encoding (``o200k_base`` for the gpt-4o / gpt-4.1 / gpt-5 / o-series
  families, ``cl100k_base`` for gpt-4 and gpt-3.5).
* Anthropic models have no public tokenizer. Their count is a calibrated estimate: code points
  divided by 3.3, the ratio DeerFlow measured for Claude, plus the same framing as the others.
* Every other model is counted with ``o200k_base``.

Per-message framing follows OpenAI's published accounting: 3 tokens of framing per message, 1 more
when it has a ``name``, and each tool call costs its name, its arguments and 3 tokens of framing.
An image block costs ``IMAGE_TOKENS`` (a 1024x1024 high-detail image on OpenAI's price list).
"""

from __future__ import annotations

import binascii
import hashlib
import math
import threading
from collections.abc import Callable, Iterable
from functools import cache
from importlib import resources
from typing import Any, Protocol

import tiktoken

from compactd.storage.messages import Message

MESSAGE_FRAMING_TOKENS = 3
NAME_TOKENS = 1
TOOL_CALL_FRAMING_TOKENS = 3
IMAGE_TOKENS = 765
ANTHROPIC_CHARS_PER_TOKEN = 3.3

# sha256 of each shipped file, as tiktoken_ext.openai_public expects them.
ENCODING_SHA256 = {
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
}

_CL100K_PREFIXES = ("gpt-4-", "gpt-4", "gpt-3.5", "text-embedding-3", "text-embedding-ada")
_O200K_PREFIXES = ("gpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "o1", "o3", "o4", "chatgpt-4o",
                   "gpt-oss")

_load_lock = threading.Lock()


def _load_ranks(name: str) -> dict[bytes, int]:
    data = resources.files("compactd.storage").joinpath(f"data/{name}.tiktoken").read_bytes()
    if hashlib.sha256(data).hexdigest() != ENCODING_SHA256[name]:
        raise RuntimeError(f"the shipped {name} encoding file is corrupt (sha256 mismatch)")
    # Every process that counts (each `compactd ingest`, each worker start) parses the file:
    # decoded in bulk rather than line by line through base64's wrapper.
    fields = data.split()
    return dict(zip(map(binascii.a2b_base64, fields[0::2]), map(int, fields[1::2]), strict=True))


@cache
def encoding(name: str) -> tiktoken.Encoding:
    """The tiktoken encoding ``name`` built from the shipped file, with no network access.

    The pattern and special tokens come from tiktoken's own constructor for that encoding; only
    its file loader is swapped for one that reads the package data, so nothing is duplicated and
    nothing is fetched.
    """
    if name not in ENCODING_SHA256:
        raise ValueError(f"no shipped encoding {name!r} (have {', '.join(ENCODING_SHA256)})")
    from tiktoken_ext import openai_public

    def load_shipped(_url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        return _load_ranks(name)

    with _load_lock:
        original = openai_public.load_tiktoken_bpe
        openai_public.load_tiktoken_bpe = load_shipped
        try:
            params = getattr(openai_public, name)()
        finally:
            openai_public.load_tiktoken_bpe = original
    return tiktoken.Encoding(**params)


def encoding_name_for(model: str | None) -> str:
    """The encoding an OpenAI-family model uses; o200k for everything unknown."""
    m = (model or "").lower().rsplit("/", 1)[-1]
    if m.startswith(_O200K_PREFIXES):
        return "o200k_base"
    if m.startswith(_CL100K_PREFIXES):
        return "cl100k_base"
    return "o200k_base"


def tokenizer_knows(model: str) -> bool:
    """Whether ``model`` names a model whose tokenizer is known by its name (OpenAI's families,
    Anthropic's), not one counted in o200k for want of knowing it."""
    m = model.lower().rsplit("/", 1)[-1]
    return is_anthropic(model) or m.startswith(_O200K_PREFIXES + _CL100K_PREFIXES)


def is_anthropic(model: str | None) -> bool:
    m = (model or "").lower()
    return "claude" in m or m.startswith("anthropic")


class TokenCounter(Protocol):
    name: str

    def count_text(self, text: str) -> int: ...

    def count_message(self, message: Message) -> int: ...


class _FramedCounter:
    """Shared framing; subclasses say how many tokens a piece of text is."""

    name = "base"

    def count_text(self, text: str) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def count_message(self, message: Message) -> int:
        total = MESSAGE_FRAMING_TOKENS + self.count_content(message.content)
        if message.name:
            total += NAME_TOKENS + self.count_text(message.name)
        for call in message.tool_calls:
            total += (TOOL_CALL_FRAMING_TOKENS + self.count_text(call.name)
                      + self.count_text(call.arguments))
        return total

    def count_content(self, content: str | list[dict[str, Any]] | None) -> int:
        if content is None:
            return 0
        if isinstance(content, str):
            return self.count_text(content)
        total = 0
        for block in content:
            kind = block.get("type")
            if kind == "text":
                total += self.count_text(str(block.get("text", "")))
            elif kind in ("image", "image_url", "input_image"):
                total += IMAGE_TOKENS
            else:
                # Opaque blocks are sent as they are; their JSON is the best estimate we have.
                total += self.count_text(_compact_json(block))
        return total


class TiktokenCounter(_FramedCounter):
    def __init__(self, encoding_name: str) -> None:
        self.name = encoding_name
        self._encode: Callable[[str], list[int]] = encoding(encoding_name).encode_ordinary

    def count_text(self, text: str) -> int:
        return len(self._encode(text)) if text else 0


class CharRatioCounter(_FramedCounter):
    """Code points divided by a calibrated characters-per-token ratio."""

    def __init__(self, chars_per_token: float, name: str) -> None:
        self.chars_per_token = chars_per_token
        self.name = name

    def count_text(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token) if text else 0


def fitting_prefix(text: str, budget: int, counter: TokenCounter, *, at_least: int = 0) -> int:
    """The length (in code points) of the longest prefix of ``text`` within ``budget`` tokens,
    and at least ``at_least``."""
    lo, hi = at_least, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if counter.count_text(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cache
def counter_for(model: str | None) -> _FramedCounter:
    """The counter for messages a given model will read."""
    if is_anthropic(model):
        return CharRatioCounter(ANTHROPIC_CHARS_PER_TOKEN, "anthropic-estimate")
    return TiktokenCounter(encoding_name_for(model))


def load_counters(models: Iterable[str | None]) -> list[str]:
    """Load the encodings ``models`` are counted with (None: a model not configured, counted
    in o200k); the names loaded. A process that counts later then does not parse a BPE file
    on its first count, which for a worker is its first compaction."""
    names = sorted({encoding_name_for(m) for m in models if not is_anthropic(m)})
    for name in names:
        encoding(name).encode_ordinary("warm")
    return names


def _compact_json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
