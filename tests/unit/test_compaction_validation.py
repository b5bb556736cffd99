"""Validation table: which summaries may be committed (step 7)."""

from __future__ import annotations

import pytest

from compactd.worker.compaction.policy import Policy
from compactd.worker.compaction.prompt import SECTIONS
from compactd.worker.compaction.render import Skill
from compactd.worker.compaction.validation import (
    NO_HISTORY_SUMMARY,
    framed_tokens,
    missing_sections,
    validate_summary,
)

POLICY = Policy(max_summary_tokens=120)
GOOD = "## Primary Request and Intent\nFix the parser.\n" + "\n".join(
    f"## {name}\n(none)" for name in SECTIONS[1:])
EMPTY = "\n\n".join(f"## {name}\n(none)" for name in SECTIONS)


@pytest.mark.parametrize(
    ("text", "replaced", "has_history", "refused"),
    [
        (GOOD, 10_000, True, None),
        ("", 10_000, True, "empty"),
        ("  \n\t ", 10_000, True, "whitespace-only"),
        (None, 10_000, True, "non-text"),
        ([{"type": "image"}], 10_000, True, "non-text"),
        (GOOD + "\nword" * 120, 10_000, True, "over max_summary_tokens"),
        # the default instruction's eight headings, as models write them; all of them
        (GOOD.replace("## Next Step", "### 7. **Next step:**"), 10_000, True, None),
        (GOOD.replace("## Next Step\n", ""), 10_000, True, "lacks 1 of the 8 section headings"),
        (GOOD.replace("## Next Step", "Next Step"), 10_000, True, "(Next Step)"),
        (GOOD[:len(GOOD) // 2], None, True, "section headings"),
        ("Fixed the parser.", 10_000, True, "lacks 8 of the 8"),
        # the framed checkpoint must be strictly smaller than what it replaces
        (GOOD, "framed", True, "not fewer than"),
        (GOOD, "framed+1", True, None),
        (NO_HISTORY_SUMMARY, 10_000, False, None),
        (NO_HISTORY_SUMMARY, 10_000, True, "canned no-history"),
        # an intermediate chunk summary is never committed: no convergence check
        (GOOD, None, True, None),
        ("", None, True, "empty"),
        # headings with nothing under them carry nothing, however the filler is written
        (EMPTY, 10_000, True, "only section headings"),
        (EMPTY.replace("(none)", "- None."), 10_000, True, "only section headings"),
        (EMPTY.replace("(none)", "N/A"), None, True, "only section headings"),
        (EMPTY.replace("(none)", "\u200b"), 10_000, True, "only section headings"),
        # ... but one line of content under one heading is a summary; and with nothing to read
        # (no history) the empty form is what there is to say
        (EMPTY.replace("## Next Step\n(none)", "## Next Step\nrun the tests"), 10_000, True,
         None),
        (EMPTY, 10_000, False, None),
        # text that renders as nothing is whitespace: zero-width space, joiners, BOM, word
        # joiner, no-break and ideographic spaces, a Hangul filler
        ("\u200b\u200c\u200d\ufeff\u2060\u00a0\u3000\u3164", 10_000, True, "whitespace-only"),
    ],
)
def test_validate_summary(text, replaced, has_history, refused):
    framed = framed_tokens(GOOD, (), POLICY, None)
    replaced = {"framed": framed, "framed+1": framed + 1}.get(replaced, replaced)
    reason = validate_summary(text, replaced_tokens=replaced, policy=POLICY, run_model=None,
                              has_history=has_history)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason


def test_framed_size_counts_skills_and_the_authority_contract():
    skills = [Skill("pdf", "/mnt/skills/pdf/SKILL.md", "Read PDFs", 4)]
    plain = framed_tokens(GOOD, (), POLICY, None)
    with_skills = framed_tokens(GOOD, skills, POLICY, None)
    assert with_skills > plain
    langchain = framed_tokens(GOOD, (), Policy(render="langchain"), None)
    assert plain > langchain  # the durable form adds the authority contract
    reason = validate_summary(GOOD, replaced_tokens=plain + 1, policy=POLICY, run_model=None,
                              skills=skills)
    assert reason is not None and "not fewer than" in reason


def test_a_custom_prompt_sets_its_own_format():
    custom = Policy(max_summary_tokens=120, summary_prompt="Summarize.\n{messages}")
    assert validate_summary("Fixed the parser.", replaced_tokens=10_000, policy=custom,
                            run_model=None) is None
    # ... but invisible text is empty and empty headings carry nothing under any prompt
    for text, refused in (("\u200b" * 40, "whitespace-only"), (EMPTY, "only section headings")):
        reason = validate_summary(text, replaced_tokens=10_000, policy=custom, run_model=None)
        assert reason is not None and refused in reason, text


def test_the_local_summarizer_never_writes_only_empty_sections_for_a_range_with_text():
    from compactd.storage.messages import Message
    from compactd.worker.llm.local import summarize_local

    # A system note is text no extraction rule picks up.
    summary = summarize_local([Message(role="system", content="deploy window is Friday " * 20)])
    assert validate_summary(summary, replaced_tokens=10_000, policy=Policy(),
                            run_model=None) is None
    assert "deploy window is Friday" in summary


def test_the_local_summarizer_writes_every_section():
    from compactd.scheduler.samples import coding_session
    from compactd.storage.messages import parse_openai
    from compactd.worker.llm.local import summarize_local

    messages = [parse_openai(m) for m in coding_session(steps=6, seed=3).messages]
    assert missing_sections(summarize_local(messages, max_tokens=2000)) == []
