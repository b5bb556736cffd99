"""What tells one append from another under an idempotency key, without I/O: the digest of a
batch (the same for the form each backend stores, different for any other batch) and the key
the LangChain middleware derives for a step (the same for a retry, another for a later step)."""

from __future__ import annotations

import pytest

from compactd.scheduler.langchain import step_key
from compactd.storage.ids import check_idempotency_key
from compactd.storage.messages import Message
from compactd.storage.store import prepare_append, request_digest


def _digest(messages: list[Message], *, encoded: bool) -> str:
    return request_digest(prepare_append(messages, None, encoded=encoded))


def test_a_batch_has_one_digest_in_either_backends_form() -> None:
    batch = [Message(role="user", content="naïve café \u2603"),
             Message(role="assistant", content="ok")]
    assert _digest(batch, encoded=True) == _digest(batch, encoded=False)


@pytest.mark.parametrize("other", [
    [Message(role="user", content="ab")],  # the two contents joined
    [Message(role="user", content="a"), Message(role="user", content="b"),
     Message(role="user", content="")],
    [Message(role="assistant", content="a"), Message(role="user", content="b")],
    [Message(role="user", content="b"), Message(role="user", content="a")],
    [Message(role="user", content="a", meta={"pinned": True}),
     Message(role="user", content="b")],
])
def test_any_other_batch_has_another_digest(other: list[Message]) -> None:
    batch = [Message(role="user", content="a"), Message(role="user", content="b")]
    assert _digest(other, encoded=True) != _digest(batch, encoded=True)


def test_a_step_retried_gets_its_key_again_and_a_later_step_another() -> None:
    payload = [{"role": "user", "content": "go on", "meta": {"lc_id": "m-1"}}]
    key = step_key("s", 12, payload)
    assert key == step_key("s", 12, [dict(m) for m in payload])
    assert check_idempotency_key(key) == key and key.startswith("lc-")
    assert step_key("s", 13, payload) != key  # the same words, one step later
    assert step_key("t", 12, payload) != key
    assert step_key("s", 12, [{**payload[0], "content": "go on!"}]) != key
