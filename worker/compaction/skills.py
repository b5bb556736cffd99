"""Loaded skills: a durable channel that survives the messages that loaded them.

A skill read is a tool call whose name is one of ``skill_file_read_tool_names``, whose path
argument lies under ``skills_path`` and names a ``SKILL.md`` file, and whose result is not an
error: neither flagged as one (``is_error``, a LangChain ``status: error``) nor a text that
says so (``Error: File not found: ...``, which DeerFlow's sandbox tools return with a success
status). A skill that failed to load is not active, and listing it would send the model to a
file that is not there.

Before the range is replaced each read becomes a reference (name, path, one-line description,
``loaded_at`` = the seq of the result), so the checkpoint can list active skills and point the
model at the file to re-read rather than carry the file's text.

When the runtime stamped the result with a ``skill_context_entry`` mapping (DeerFlow's bounded
metadata), its name and description win over anything parsed from the transcript; its path must
still match the call's. Otherwise the name and description come from the file's YAML
frontmatter when the result shows it, and the name falls back to the skill's folder.

At most :data:`MAX_SKILLS`, one per path; a re-read refreshes ``loaded_at``, and the most recently
loaded ones are kept. Skills of an earlier checkpoint inside the range are merged in.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence

from compactd.storage.messages import META_SKILL, Message
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.boundary import is_checkpoint
from compactd.worker.compaction.render import Skill, checkpoint_parts

MAX_SKILLS = 8
SKILL_FILE = "SKILL.md"
DESCRIPTION_MAX_CHARS = 240
PATH_ARGUMENTS = ("path", "file_path", "filepath", "file", "filename", "target_file",
                  "absolute_path")
# How file tools that report failure as text begin their answer. A SKILL.md read whole starts
# with its frontmatter or a heading, never with this.
ERROR_TEXT = re.compile(r"\s*error:", re.IGNORECASE)


def skill_path(arguments: str, skills_path: str) -> str | None:
    """The normalized ``SKILL.md`` path a read call names, if it is one under ``skills_path``."""
    if not isinstance(arguments, str):  # stored surfaces are rebuilt without validation
        return None
    if SKILL_FILE not in arguments and "\\u" not in arguments:
        # Exact without decoding: only a \u escape can spell the name differently in JSON
        # text. Every plan looks at every read call of its range, so most skip the decode.
        return None
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(args, Mapping):
        return None
    raw = next((args[k] for k in PATH_ARGUMENTS if isinstance(args.get(k), str)), None)
    if not raw:
        return None
    path = posixpath.normpath(raw)
    root = posixpath.normpath(skills_path)
    if posixpath.basename(path) != SKILL_FILE or not path.startswith(root.rstrip("/") + "/"):
        return None
    return path


def frontmatter(text: str) -> dict[str, str]:
    """``key: value`` pairs of a leading ``---`` YAML block (folded values joined on one line).

    Deliberately small: a skill file's frontmatter is flat, and a tool result may show only part
    of it; anything unparseable is simply absent.
    """
    lines = text.lstrip("\ufeff \n").splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    out: dict[str, str] = {}
    key: str | None = None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        if key is not None and line[:1] in (" ", "\t") and line.strip():
            out[key] = f"{out[key]} {line.strip()}".strip()
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip() or name[:1] in (" ", "\t", "#"):
            key = None
            continue
        key = name.strip()
        value = value.strip()
        out[key] = "" if value in ("|", ">", "|-", ">-") else value.strip("'\"")
    return out


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    if len(line) > DESCRIPTION_MAX_CHARS:
        line = line[:DESCRIPTION_MAX_CHARS - 3].rstrip() + "..."
    return line


def failed_read(result: Message) -> bool:
    """Whether a read's result says it failed, by flag or by its text."""
    return bool(result.meta.get("is_error")) or ERROR_TEXT.match(result.text) is not None


def skill_from_read(path: str, result: Message, seq: int) -> Skill:
    entry = result.meta.get(META_SKILL)
    if isinstance(entry, Mapping) and entry.get("path") in (None, path):
        name = str(entry.get("name") or "")
        description = str(entry.get("description") or "")
    else:
        fields = frontmatter(result.text)
        name, description = fields.get("name", ""), fields.get("description", "")
    name = name or posixpath.basename(posixpath.dirname(path)) or path
    return Skill(name=_one_line(name), path=path, description=_one_line(description),
                 loaded_at=seq)


def capture_skills(nodes: Sequence[SurfaceNode], *, tool_names: Iterable[str],
                   skills_path: str) -> list[Skill]:
    """Skills loaded or carried inside ``nodes`` (the range), newest :data:`MAX_SKILLS`."""
    names = set(tool_names)
    found: list[Skill] = []
    reads: dict[str, str] = {}  # call id -> skill path
    for node in nodes:
        message = node.message
        if is_checkpoint(node):
            found.extend(checkpoint_parts(message)[1])
            continue
        if names:
            for call in message.tool_calls:
                if call.name in names:
                    path = skill_path(call.arguments, skills_path)
                    if path is not None:
                        reads[call.id] = path
        if (message.role == "tool" and message.tool_call_id in reads
                and not failed_read(message)):
            found.append(skill_from_read(reads[message.tool_call_id], message, node.seq))
    return merge_skills(found)


def merge_skills(skills: Iterable[Skill]) -> list[Skill]:
    """One per path (the latest load wins), the newest :data:`MAX_SKILLS`, oldest first."""
    by_path: dict[str, Skill] = {}
    for skill in skills:
        held = by_path.get(skill.path)
        if held is None or skill.loaded_at >= held.loaded_at:
            by_path[skill.path] = skill
    newest = sorted(by_path.values(), key=lambda s: (s.loaded_at, s.path))
    return newest[-MAX_SKILLS:]
