"""Image parts in the summarizer's input keep their reference (item 23 of issue 15)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from compactd.storage.messages import parse_openai
from compactd.worker.compaction.prompt import IMAGE_REFERENCE_CHARS, image_reference, message_body

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # 1032 bytes
B64 = base64.b64encode(PNG).decode()
URL = "https://cdn.example.com/shots/build-42.png?sig=a1b2&exp=99"


@pytest.mark.parametrize(("block", "expected"), [
    # OpenAI chat
    ({"type": "image_url", "image_url": {"url": URL, "detail": "high"}}, f"[image: {URL}]"),
    ({"type": "image_url", "image_url": URL}, f"[image: {URL}]"),
    ({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}},
     "[image: image/png, 1032 bytes inline]"),
    # OpenAI Responses
    ({"type": "input_image", "image_url": URL}, f"[image: {URL}]"),
    ({"type": "input_image", "file_id": "file-abc123"}, "[image: file file-abc123]"),
    # Anthropic
    ({"type": "image", "source": {"type": "url", "url": URL}}, f"[image: {URL}]"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": B64}},
     "[image: image/jpeg, 1032 bytes inline]"),
    ({"type": "image", "source": {"type": "file", "file_id": "file_011"}},
     "[image: file file_011]"),
    # LangChain standard blocks, current and older
    ({"type": "image", "url": URL}, f"[image: {URL}]"),
    ({"type": "image", "base64": B64, "mime_type": "image/webp"},
     "[image: image/webp, 1032 bytes inline]"),
    ({"type": "image", "source_type": "base64", "data": B64, "mime_type": "image/gif"},
     "[image: image/gif, 1032 bytes inline]"),
    ({"type": "image", "file_id": "f-1"}, "[image: file f-1]"),
    # inline without a media type, percent-encoded data, nothing to refer to
    ({"type": "image_url", "image_url": {"url": "data:;base64,AAAA"}},
     "[image: unknown type, 3 bytes inline]"),
    ({"type": "image_url", "image_url": {"url": "data:image/svg+xml,%3Csvg%3E"}},
     "[image: image/svg+xml, 5 bytes inline]"),
    ({"type": "image"}, "[image]"),
    ({"type": "image_url", "image_url": {"url": ""}}, "[image]"),
])
def test_an_image_part_reads_as_its_reference(block: dict[str, Any], expected: str) -> None:
    assert image_reference(block) == expected
    assert B64[:40] not in image_reference(block)


def test_a_very_long_reference_is_cut_and_says_so() -> None:
    url = "https://example.com/" + "x" * 5000
    text = image_reference({"type": "image_url", "image_url": {"url": url}})
    assert text.startswith(f"[image: {url[:IMAGE_REFERENCE_CHARS]}... ")
    assert f"({len(url)} characters)" in text and len(text) < IMAGE_REFERENCE_CHARS + 50


def test_the_transcript_keeps_the_url_in_place_between_the_text() -> None:
    message = parse_openai({"role": "user", "content": [
        {"type": "text", "text": "the layout breaks here:"},
        {"type": "image_url", "image_url": {"url": URL}},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}},
        {"type": "text", "text": "see both"}]})
    assert message_body(message) == ("the layout breaks here:\n"
                                     f"[image: {URL}]\n"
                                     "[image: image/png, 1032 bytes inline]\n"
                                     "see both")
