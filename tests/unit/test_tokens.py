from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from compactd.storage.messages import parse_openai
from compactd.storage.tokens import (
    IMAGE_TOKENS,
    MESSAGE_FRAMING_TOKENS,
    counter_for,
    encoding,
    encoding_name_for,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("model", "name"), [
    ("gpt-4o", "o200k_base"), ("gpt-4o-mini", "o200k_base"), ("gpt-4.1", "o200k_base"),
    ("gpt-5", "o200k_base"), ("o3-mini", "o200k_base"), ("openai/gpt-4o", "o200k_base"),
    ("gpt-4", "cl100k_base"), ("gpt-4-turbo", "cl100k_base"), ("gpt-3.5-turbo", "cl100k_base"),
    ("deepseek-chat", "o200k_base"), (None, "o200k_base"),
])
def test_encoding_by_model(model: str | None, name: str) -> None:
    assert encoding_name_for(model) == name


def test_shipped_encodings_match_tiktoken_reference_counts() -> None:
    # Known token ids from OpenAI's published encodings.
    assert encoding("cl100k_base").encode("hello world") == [15339, 1917]
    assert encoding("o200k_base").encode("hello world") == [24912, 2375]


def test_message_framing() -> None:
    c = counter_for("gpt-4o")
    m = parse_openai({"role": "user", "content": "hello world"})
    assert c.count_message(m) == MESSAGE_FRAMING_TOKENS + 2
    named = parse_openai({"role": "tool", "tool_call_id": "x", "name": "bash", "content": "ok"})
    assert c.count_message(named) == MESSAGE_FRAMING_TOKENS + 1 + c.count_text("bash") + 1


def test_tool_calls_and_images_are_counted() -> None:
    c = counter_for("gpt-4o")
    m = parse_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "grep", "arguments": '{"pattern": "round"}'}}]})
    assert c.count_message(m) > MESSAGE_FRAMING_TOKENS + 3
    img = parse_openai({"role": "user", "content": [{"type": "image_url",
                                                     "image_url": {"url": "data:..."}}]})
    assert c.count_message(img) == MESSAGE_FRAMING_TOKENS + IMAGE_TOKENS


def test_anthropic_is_a_calibrated_estimate() -> None:
    c = counter_for("claude-sonnet-4-5")
    assert c.count_text("x" * 33) == 10
    assert c.count_text("") == 0


def test_tokenizer_loads_with_the_network_unreachable(tmp_path: Path) -> None:
    """A fresh interpreter with every socket refused and an empty tiktoken cache still counts."""
    script = textwrap.dedent("""
        import socket
        def refuse(*a, **k):
            raise OSError("network unreachable (test)")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        from compactd.storage.tokens import counter_for
        print(counter_for("gpt-4o").count_text("offline works"),
              counter_for("gpt-4").count_text("offline works"))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"),
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2"]
    # The user's cache dir is neither filled nor required.
    assert not (tmp_path / "empty").exists()
