"""Probes (``worker.probes``): each kind is taken from the messages a compaction replaced, and the
words a model would search for one leave its value out."""

from __future__ import annotations

from typing import Any

from compactd.storage.messages import parse_openai
from compactd.worker.probes import Probe, extract, query_words, vocabulary

MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Fix the nightly export. Never touch the migrations folder. "
                                "The report is due friday."},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_order", "arguments": '{"order_id": "ord_8812", "n": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "get_order",
     "content": "Traceback (most recent call last):\n  File \"src/export/writer.py\", line 12\n"
                "TimeoutError: flush of ticket EXP-4107 stalled after 950 ms at 12 MB\n"
                "refund $120.50 pending for 2 bags"},
]


def _probes() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for probe in extract([parse_openai(m) for m in MESSAGES]):
        out.setdefault(probe.kind, []).append(probe.value)
    return out


def test_every_kind_is_extracted() -> None:
    found = _probes()
    assert found["ids"] == ["ord_8812", "EXP-4107"]
    assert found["paths"] == ["src/export/writer.py"]
    assert found["errors"] == ["TimeoutError"]
    assert found["numbers"] == ["950 ms", "12 MB", "$120.50", "2 bags"]
    # The instruction, not the sentences that only state things.
    assert found["instructions"] == ["Never touch the migrations folder."]


def test_query_words_leave_the_value_out_and_prefer_rare_words() -> None:
    holder = MESSAGES[2]["content"]
    counts = vocabulary([holder, "flush flush flush stalled stalled"])
    words = query_words(Probe("ids", "EXP-4107"), holder, counts)
    # The line's words but the value's, the most common one (flush) left out, in line order.
    assert words == "timeouterror ticket stalled"
    assert query_words(Probe("instructions", "Never touch the migrations folder."), "",
                       counts) == "touch migrations folder"


def test_a_file_view_passed_as_a_user_turn_gives_no_instruction() -> None:
    view = ("1432:     Always serializes to an integer value.\n"
            "1463:     msg = 'The precision must be {} or {}'.\n"
            "    always returns a writeable array.\n")
    assert extract([parse_openai({"role": "user", "content": view})]) == []
