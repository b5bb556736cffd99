"""Durable skills captured from the range before it is replaced."""

from __future__ import annotations

import pytest

from compactd.worker.compaction.render import Skill, render_text
from compactd.worker.compaction.skills import MAX_SKILLS, capture_skills, frontmatter, skill_path
from tests.support.surfaces import ai, ckpt, nodes, tool, user

TOOLS = ("read_file", "read", "view", "cat")
FRONT = "---\nname: pdf-tools\ndescription: Read and fill PDF forms.\n---\n# PDF\nsteps"


def _capture(*messages):
    return capture_skills(nodes(*messages), tool_names=TOOLS, skills_path="/mnt/skills")


def _read(call_id, path, result=FRONT, tool_name="read_file", **meta):
    return [ai("", (call_id, tool_name, {"path": path})), tool(call_id, result, **meta)]


@pytest.mark.parametrize(
    ("arguments", "path"),
    [
        ('{"path": "/mnt/skills/pdf/SKILL.md"}', "/mnt/skills/pdf/SKILL.md"),
        ('{"file_path": "/mnt/skills/a/b/SKILL.md"}', "/mnt/skills/a/b/SKILL.md"),
        ('{"path": "/mnt/skills/pdf/../x/SKILL.md"}', "/mnt/skills/x/SKILL.md"),
        ('{"path": "/mnt/skills/pdf/README.md"}', None),
        ('{"path": "/mnt/skillsX/pdf/SKILL.md"}', None),
        ('{"path": "/mnt/skills/../etc/SKILL.md"}', None),
        ('{"path": "/home/SKILL.md"}', None),
        ("not json", None),
        ('["/mnt/skills/pdf/SKILL.md"]', None),
        # The name spelled with JSON escapes is still the name.
        ('{"path": "/mnt/skills/pdf/SKILL\\u002emd"}', "/mnt/skills/pdf/SKILL.md"),
        ('{"path": "/mnt/skills/pdf/\\u0053KILL.md"}', "/mnt/skills/pdf/SKILL.md"),
        # Arguments that are no text (never validated on a rebuilt surface) name nothing.
        (None, None),
        ({"path": "/mnt/skills/pdf/SKILL.md"}, None),
    ],
)
def test_skill_path(arguments, path):
    assert skill_path(arguments, "/mnt/skills") == path


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        (FRONT, {"name": "pdf-tools", "description": "Read and fill PDF forms."}),
        ("---\nname: x\ndescription: >\n  folded across\n  two lines\n---\n",
         {"name": "x", "description": "folded across two lines"}),
        ("---\nname: 'quoted'\n---", {"name": "quoted"}),
        ("# no frontmatter\nname: x", {}),
        ("", {}),
    ],
)
def test_frontmatter(text, fields):
    assert frontmatter(text) == fields


def test_capture_name_description_loaded_at():
    skills = _capture(user("go"), *_read("c1", "/mnt/skills/pdf/SKILL.md"))
    assert skills == [Skill("pdf-tools", "/mnt/skills/pdf/SKILL.md", "Read and fill PDF forms.",
                            3)]


def test_capture_rules():
    skills = _capture(
        *_read("c1", "/mnt/skills/a/SKILL.md", "no frontmatter here"),  # name from the folder
        *_read("c2", "/mnt/skills/b/SKILL.md", is_error=True),  # an error result: skipped
        *_read("c3", "/mnt/skills/c/SKILL.md", tool_name="bash"),  # not a read tool: skipped
        *_read("c4", "/mnt/skills/d/notes.md"),  # not SKILL.md: skipped
        *_read("c5", "/mnt/skills/e/SKILL.md", "x",
               skill_context_entry={"name": "meta-name", "description": "from metadata",
                                    "path": "/mnt/skills/e/SKILL.md"}),
    )
    assert [(s.name, s.description, s.loaded_at) for s in skills] == [
        ("a", "", 2), ("meta-name", "from metadata", 10)]


@pytest.mark.parametrize("result", [
    "Error: File not found: /mnt/skills/pdf/SKILL.md",  # DeerFlow's sandbox, success status
    "  error: permission denied",
    [{"type": "text", "text": "Error: File not found: /mnt/skills/pdf/SKILL.md"}],
])
def test_a_read_whose_text_says_it_failed_is_no_skill(result):
    assert _capture(*_read("c1", "/mnt/skills/pdf/SKILL.md", result)) == []


def test_a_skill_whose_text_mentions_errors_later_is_still_one():
    text = "---\nname: errors\ndescription: Error: handling guide\n---\nError: is a heading"
    [skill] = _capture(*_read("c1", "/mnt/skills/errors/SKILL.md", text))
    assert skill.name == "errors"


def test_reread_refreshes_and_at_most_eight_newest():
    messages = []
    for i in range(10):
        messages += _read(f"c{i}", f"/mnt/skills/s{i}/SKILL.md")
    messages += _read("again", "/mnt/skills/s0/SKILL.md")
    skills = _capture(*messages)
    assert len(skills) == MAX_SKILLS
    assert [s.path for s in skills][-1] == "/mnt/skills/s0/SKILL.md"
    assert skills[-1].loaded_at == 22
    assert "/mnt/skills/s1/SKILL.md" not in [s.path for s in skills]


def test_merged_with_skills_of_an_earlier_checkpoint():
    old = Skill("old", "/mnt/skills/old/SKILL.md", "kept", 1)
    stale = Skill("pdf-tools", "/mnt/skills/pdf/SKILL.md", "stale", 1)
    skills = capture_skills(
        nodes(ckpt("before", [old, stale]), *_read("c1", "/mnt/skills/pdf/SKILL.md"), start=5),
        tool_names=TOOLS, skills_path="/mnt/skills")
    assert [(s.name, s.description) for s in skills] == [
        ("old", "kept"), ("pdf-tools", "Read and fill PDF forms.")]


def test_no_tool_names_disables_capture():
    assert capture_skills(nodes(*_read("c1", "/mnt/skills/pdf/SKILL.md")), tool_names=(),
                          skills_path="/mnt/skills") == []


def test_rendered_list_tells_the_model_to_reread():
    skill = Skill("pdf-tools", "/mnt/skills/pdf/SKILL.md", "Read PDFs.", 3)
    text = render_text("summary", [skill], "langchain")
    assert "re-read the file before applying" in text
    assert "- pdf-tools: Read PDFs. -> /mnt/skills/pdf/SKILL.md" in text
