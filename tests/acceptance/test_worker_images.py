"""Image parts reach the summarizer as their references, through a real Celery worker and the
openai SDK against the fake provider (item 23 of issue 15): an image referenced by URL stays
recoverable from the checkpoint, and an inline image's bytes never reach the model."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import pytest

from tests.support.fake_provider import FakeProvider
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

URL = "https://cdn.example.com/shots/build-42.png"
INLINE = base64.b64encode(bytes(range(256)) * 8).decode()  # 2048 bytes


def test_a_queued_run_sends_the_summarizer_the_image_references(
        make_stack: Callable[..., Stack], fake: FakeProvider) -> None:
    stack = make_stack(summarization={"trigger": [{"type": "tokens", "value": 100_000}],
                                      "keep": {"type": "messages", "value": 2},
                                      "model_name": "fake-gpt",
                                      # A shared call sends what the runtime sends, its images
                                      # too: this is the transcript the summarizer reads else.
                                      "share_cache": False})
    stack.start_worker("w1", concurrency=1)
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "the login page renders wrong, screenshots:"},
            {"type": "image_url", "image_url": {"url": URL}},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{INLINE}"}}]},
        {"role": "assistant", "content": "The header overlaps the form; fixing the CSS."},
        {"role": "user", "content": "thanks, now the footer"},
        {"role": "assistant", "content": "Looking at the footer."},
    ]
    stack.ingest("s1", messages)
    result = stack.cli_json("compact", "s1", "--wait", "--force", "--timeout", "120")
    assert result["outcome"] == "committed", result
    sent = json.dumps([r.body for r in fake.requests_for(model="fake-gpt")])
    assert f"[image: {URL}]" in sent
    assert "[image: image/png, 2048 bytes inline]" in sent
    assert INLINE[:64] not in sent
