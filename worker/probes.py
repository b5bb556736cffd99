"""Probes: the details of a conversation a compaction should not lose, and how a model would ask
for one it no longer sees.

A probe is an exact string taken from messages a compaction replaced: an identifier (a ticket-like
id such as ``ABC-123``, or the value of a tool-call argument named ``id`` or ``*_id``), a file path
or an exception name in a tool result (what the local summarizer is built to keep,
``worker.llm.local.tool_result_facts``), a number with its unit (``250 ms``, ``3.5 GB``,
``$120``), or a sentence of the user's that tells the agent what to do or not to do. Pure
functions: ``compactd eval`` and ``tests/bench/corpus.py`` extract with them
(``worker.replay``) and ask ``history_search`` with :func:`query_words`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from compactd.storage.messages import Message
from compactd.worker.llm.local import tool_result_facts

TICKET = re.compile(r"(?<![\w-])[A-Z][A-Z0-9]{1,9}-\d{2,}(?![\w-])")
ID_KEY = re.compile(r"(?:^|_)id$", re.IGNORECASE)
MIN_ID_CHARS = 3
_UNITS = (r"ms|msec|s|sec|secs|seconds?|min|mins|minutes?|h|hrs?|hours?|days?|weeks?|"
          r"[kmgt]i?b|bytes?|%|percent|tokens?|usd|eur|kg|g|lbs?|km|mi|miles?|px|rps|qps|"
          r"requests?|rows?|items?|bags?|passengers?|nights?")
NUMBER_WITH_UNIT = re.compile(
    rf"(?<![\w.$])(?:\$\d[\d,]*(?:\.\d+)?|\d[\d,]*(?:\.\d+)?\s?(?:{_UNITS}))(?![\w])",
    re.IGNORECASE)
# A user's sentence that tells the agent what to do: it starts with one of these words (after an
# optional "please"), or holds one of the phrases after them.
_INSTRUCTION = re.compile(
    r"^(?:please\s+)?(?:always|never|do not|don't|make sure|be sure|remember|only|keep|use|"
    r"avoid|stop)\b|\b(?:you must|you should|do not|don't|never|always|make sure|please)\b",
    re.IGNORECASE)
# What prose does not hold: code, markup, a numbered listing's line (a runtime may pass a file's
# view as a user turn); a sentence also starts with a capital, not mid-line.
_CODE = re.compile(r"[{}<>=;`\[\]\\\"]|^\s*\d+\s*[:.)]|\s{2,}")
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]?")
MIN_INSTRUCTION_CHARS = 12
MAX_INSTRUCTION_CHARS = 160
_WORD = re.compile(r"[A-Za-z]{4,}")
QUERY_WORDS = 3
_STOPWORDS_TEXT = """this that with from have will would could should there their them they then
than what when where which while your yours about into only also just some such more most very
been were here like make sure please always never must does done each other over under after
before because between these those being doing okay thanks thank want need know"""
STOPWORDS = frozenset(_STOPWORDS_TEXT.split())

KINDS = ("ids", "paths", "errors", "numbers", "instructions")


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str  # one of KINDS
    value: str  # the exact string looked for


def extract(messages: Sequence[Message]) -> list[Probe]:
    """Every probe of ``messages``, each value once, in the order of :data:`KINDS`."""
    paths, errors = tool_result_facts(messages)
    found: dict[str, dict[str, None]] = {kind: {} for kind in KINDS}
    found["paths"].update(dict.fromkeys(paths))
    found["errors"].update(dict.fromkeys(errors))
    for message in messages:
        found["ids"].update(dict.fromkeys(identifiers(message)))
        found["numbers"].update(dict.fromkeys(
            m.group(0).strip() for m in NUMBER_WITH_UNIT.finditer(message.text)))
        if message.role == "user":
            found["instructions"].update(dict.fromkeys(instructions(message.text)))
    seen: set[str] = set()
    out = []
    for kind in KINDS:
        for value in found[kind]:
            if value not in seen:
                seen.add(value)
                out.append(Probe(kind, value))
    return out


def identifiers(message: Message) -> list[str]:
    """Ticket-like ids in the text and the string values of id arguments of its tool calls."""
    out = dict.fromkeys(TICKET.findall(message.text))
    for call in message.tool_calls:
        try:
            args = json.loads(call.arguments)
        except ValueError:
            continue
        if isinstance(args, dict):
            out.update(dict.fromkeys(v for k, v in args.items() if ID_KEY.search(k)
                                     and isinstance(v, str) and len(v) >= MIN_ID_CHARS))
    return list(out)


def instructions(text: str) -> list[str]:
    """The sentences of a user's message that tell the agent what to do, as written (prose, not
    a file or a listing a runtime passed as a user turn)."""
    out = []
    for match in _SENTENCE.finditer(text):
        sentence = match.group(0).strip()
        if (MIN_INSTRUCTION_CHARS <= len(sentence) <= MAX_INSTRUCTION_CHARS
                and sentence[0].isupper() and _INSTRUCTION.search(sentence)
                and not _CODE.search(sentence)):
            out.append(sentence)
    return out


def vocabulary(texts: Iterable[str]) -> Counter[str]:
    """How often each word (four letters or more, lower-cased) occurs in ``texts``."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w.lower() for w in _WORD.findall(text))
    return counts


def query_words(probe: Probe, holder: str, counts: Counter[str]) -> str:
    """What a model that remembers the gist but not the value would search for: the rarest words
    (in the session) of the line that holds the value, the value left out, in the line's order;
    for an instruction, of the sentence itself. Falls back to the value's own words."""
    if probe.kind == "instructions":
        context = probe.value
    else:
        line = next((ln for ln in holder.splitlines() if probe.value in ln), "")
        context = line.replace(probe.value, " ")
    words = list(dict.fromkeys(w.lower() for w in _WORD.findall(context)
                               if w.lower() not in STOPWORDS))
    if not words:
        words = list(dict.fromkeys(w.lower() for w in _WORD.findall(probe.value)))
    chosen = set(sorted(words, key=lambda w: (counts.get(w, 0), w))[:QUERY_WORDS])
    return " ".join(w for w in words if w in chosen)
