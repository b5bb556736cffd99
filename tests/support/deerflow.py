"""A conversation as DeerFlow's lead agent leaves it in its state: LangChain messages carrying
DeerFlow's tags, for the tests that store it through ``CompactdMiddleware`` and through
``compactd ingest --format langchain`` and compare what compaction keeps.

* the user's request, then DeerFlow's memory reminder (``name="__memory"``, tagged
  ``dynamic_context_reminder`` and ``hide_from_ui`` in ``additional_kwargs``);
* three skill reads: one whose file is missing (the sandbox answers ``Error: File not found``
  with a success status), one refused (``status="error"``, a text that does not say so), one
  that loads ``pdf-forms``;
* long tool steps, and a hidden nudge (``hide_from_ui``, not a user request) among them;
* a last answer.
"""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

REQUEST = "Fill in the tax form at /mnt/user-data/uploads/form.pdf with my 2025 numbers."
MEMORY = "<memory>The user files taxes in Germany and prefers euros.</memory>"
NUDGE = "<system-reminder>Keep going with the form.</system-reminder>"
MISSING_SKILL = "/mnt/skills/public/pdf/SKILL.md"
REFUSED_SKILL = "/mnt/skills/public/xlsx/SKILL.md"
LOADED_SKILL = "/mnt/skills/public/pdf-forms/SKILL.md"
SKILL_TEXT = ("---\nname: pdf-forms\ndescription: Fill and flatten PDF forms.\n---\n"
              "# PDF forms\n1. list the fields\n2. fill them\n")
STEP_OUTPUT = "field value row " * 300


def _read(n: int, path: str, result: str, status: str = "success") -> list[BaseMessage]:
    call_id = f"read-{n}"
    return [AIMessage("", id=f"a-read-{n}",
                      tool_calls=[{"id": call_id, "name": "read_file", "args": {"path": path}}]),
            ToolMessage(result, tool_call_id=call_id, name="read_file", id=f"t-read-{n}",
                        status=status)]


def _step(n: int) -> list[BaseMessage]:
    call_id = f"bash-{n}"
    return [AIMessage(f"Step {n}: reading more fields.", id=f"a-step-{n}",
                      tool_calls=[{"id": call_id, "name": "bash",
                                   "args": {"command": f"pdftk form.pdf dump_data {n}"}}]),
            ToolMessage(f"step {n}: {STEP_OUTPUT}", tool_call_id=call_id, name="bash",
                        id=f"t-step-{n}")]


def conversation(steps: int = 6) -> list[BaseMessage]:
    messages: list[BaseMessage] = [
        HumanMessage(REQUEST, id="u-request"),
        HumanMessage(MEMORY, name="__memory", id="u-memory",
                     additional_kwargs={"dynamic_context_reminder": True, "hide_from_ui": True}),
        *_read(1, MISSING_SKILL, f"Error: File not found: {MISSING_SKILL}"),
        *_read(2, REFUSED_SKILL, f"Permission denied: {REFUSED_SKILL}", status="error"),
        *_read(3, LOADED_SKILL, SKILL_TEXT),
    ]
    for n in range(1, steps + 1):
        messages += _step(n)
        if n == steps // 2:
            messages.append(HumanMessage(NUDGE, id="u-nudge",
                                         additional_kwargs={"hide_from_ui": True}))
    messages.append(AIMessage("The form is filled.", id="a-done"))
    return messages


def ingest_lines(messages: list[BaseMessage]) -> str:
    """The messages as ``ingest --format langchain`` reads them (``model_dump`` per line)."""
    return "".join(json.dumps(m.model_dump()) + "\n" for m in messages)


def kept(surface: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """What a ``surface --json`` kept verbatim: (role, text, error flag) of each message that
    is not a checkpoint, in order."""
    out = []
    for m in surface["messages"]:
        meta = m.get("meta") or {}
        if meta.get("checkpoint"):
            continue
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        out.append((m["role"], text, bool(meta.get("is_error"))))
    return out


def active_skills(surface: dict[str, Any]) -> list[str]:
    """The skill paths the surface's checkpoints list as active."""
    paths = []
    for m in surface["messages"]:
        if (m.get("meta") or {}).get("checkpoint"):
            text = m["content"] if isinstance(m["content"], str) else json.dumps(m["content"])
            paths += [line.rsplit(" -> ", 1)[1] for line in text.splitlines()
                      if line.startswith("- ") and " -> " in line]
    return paths
