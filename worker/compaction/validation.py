"""Whether a summary may be committed: pipeline step 7.

A refused summary is that candidate's failure and the next candidate is tried, so every check
returns a reason rather than raising. Refused:

* anything that is not text (a reasoning-only reply, an image, a tool call arrives as non-text);
* empty or whitespace-only text: an empty summary is a failed generation, never a valid one.
  Whitespace includes what renders as nothing: format characters (zero-width space and joiners,
  the byte-order mark, Unicode category Cf), controls, lone combining marks and the blank
  letters (Hangul fillers, the blank Braille pattern), which ``str.strip`` keeps;
* for a range with history, a summary that is only the eight section headings with nothing, or
  a ``(none)``-style filler, under any of them: it has the form asked for and carries nothing,
  so the range would be dropped silently;
* a summary over ``max_summary_tokens`` (later chunk calls reserved only that much for it);
* a summary whose framed checkpoint (rendered form, skills, recall footer, authority contract)
  is not strictly smaller than the tokens it replaces: compaction must converge, never grow the
  surface;
* the canned "no history" text for a range that has history (a model parroting it lost the
  range). For a range with nothing to read it is the valid canned summary, with no model call;
* with compactd's own instruction (no ``summary_prompt``), a summary missing any of the eight
  section headings it asks for: a reply cut short, or one that ignored the format, leaves the
  agent without the sections it will look for (a custom prompt sets its own format).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Any

from compactd.storage.tokens import counter_for
from compactd.worker.compaction.policy import Policy
from compactd.worker.compaction.prompt import SECTIONS
from compactd.worker.compaction.render import Skill, checkpoint_message, checkpoint_tokens

NO_HISTORY_SUMMARY = "No previous conversation history."
# What the refusal of a summary whose checkpoint would not shrink the surface says: a run whose
# every candidate was refused for it ends with nothing to do (the range is too small to shrink,
# and a later run replaces it once it has grown), not as a failed run.
NOT_SMALLER = "not fewer than the"

# A section heading as models write the one asked for ("## Current Work"): any Markdown level,
# optionally numbered or bold, optionally ending in a colon, alone on its line.
_HEADINGS = {name: re.compile(r"^[ \t]*#{1,6}[ \t]*(?:\d+[.)][ \t]*)?(?:\*\*)?[ \t]*"
                              + re.escape(name) + r"[ \t]*:?[ \t]*(?:\*\*)?[ \t]*:?[ \t]*$",
                              re.IGNORECASE | re.MULTILINE)
             for name in SECTIONS}


# Characters that render as nothing but that ``str.isspace`` does not count.
_BLANK_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zs", "Zl", "Zp", "Mn", "Me"})
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
# What a model writes under a heading with nothing to report (compactd's instruction asks for
# "(none)"), with any list marker, emphasis or closing punctuation around it.
_FILLER = re.compile(r"^[-*+•>\s]*[(\[_*]*(?:none|n/?a|nothing(?: to report)?|empty|nil|"
                     r"not applicable|no (?:content|information|details)|-+|—|–)"
                     r"[)\]_*.:]*\s*$", re.IGNORECASE)


def is_blank(text: str) -> bool:
    """Whether ``text`` renders as nothing: only whitespace and invisible characters."""
    return all(ch.isspace() or ch in _BLANK_LETTERS
               or unicodedata.category(ch) in _BLANK_CATEGORIES for ch in text)


def visible_text(text: str) -> str:
    """``text`` without the invisible characters :func:`is_blank` ignores."""
    return "".join(ch for ch in text if not is_blank(ch) or ch in "\n\t ")


def only_empty_sections(text: str) -> bool:
    """Whether ``text`` holds section headings and nothing under any of them (blank lines and
    fillers such as "(none)" only)."""
    headings = 0
    for line in visible_text(text).splitlines():
        if not line.strip() or _FILLER.match(line):
            continue
        if any(heading.fullmatch(line) for heading in _HEADINGS.values()):
            headings += 1
            continue
        return False
    return headings > 0


def missing_sections(text: str) -> list[str]:
    """The default instruction's section headings that ``text`` lacks, in their order."""
    return [name for name, heading in _HEADINGS.items() if not heading.search(text)]


def framed_tokens(text: str, skills: Sequence[Skill], policy: Policy,
                  run_model: str | None, recall: dict[str, Any] | None = None) -> int:
    """Tokens the checkpoint would cost on the surface, as the run model will be sent it
    (its recall footer included)."""
    return checkpoint_tokens(checkpoint_message(text, skills, policy.render, recall=recall),
                             run_model)


def validate_summary(text: object, *, replaced_tokens: int | None, policy: Policy,
                     run_model: str | None, skills: Sequence[Skill] = (),
                     has_history: bool = True, recall: dict[str, Any] | None = None
                     ) -> str | None:
    """The reason ``text`` is refused, or None when it may be committed.

    ``replaced_tokens`` None checks an intermediate chunk's running summary: it is never
    committed, so only the text checks and ``max_summary_tokens`` apply (the next call reserved
    exactly that much for it).
    """
    if not isinstance(text, str):
        return f"non-text summary output ({type(text).__name__})"
    if is_blank(text):
        return "empty or whitespace-only summary"
    canned = text.strip() == NO_HISTORY_SUMMARY
    if canned and has_history:
        return "the canned no-history summary for a range that has history"
    if has_history and only_empty_sections(text):
        return "summary has only section headings, with nothing under any of them"
    if policy.summary_prompt is None and not canned:
        missing = missing_sections(text)
        if missing:
            return (f"summary lacks {len(missing)} of the {len(SECTIONS)} section headings "
                    f"({', '.join(missing)})")
    tokens = counter_for(run_model).count_text(text)
    if tokens > policy.max_summary_tokens:
        return f"summary is {tokens} tokens, over max_summary_tokens {policy.max_summary_tokens}"
    if replaced_tokens is None:
        return None
    framed = framed_tokens(text, skills, policy, run_model, recall)
    if framed >= replaced_tokens:
        return (f"framed summary is {framed} tokens, {NOT_SMALLER} {replaced_tokens} "
                "tokens it replaces")
    return None
