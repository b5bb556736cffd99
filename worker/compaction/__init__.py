"""The pure compaction policy: when to compact, what to prune and what to summarize, the summary
prompt, and whether a summary is acceptable.

Plain data in (surface nodes with token counts, a resolved policy, ``now``), plain data out (a
plan, prompts, a validation verdict). Nothing here imports Celery, SQLAlchemy, Redis or an HTTP or
model SDK, and nothing does I/O; ``tests/unit/test_compaction_imports.py`` holds that line.
"""

from __future__ import annotations

from compactd.worker.compaction.planner import (
    Plan,
    SummarizeStep,
    checkpoint_for,
    plan,
    replan_smaller,
)
from compactd.worker.compaction.policy import Clause, Policy, PolicyError, parse_policy
from compactd.worker.compaction.prompt import Piece, SummaryCall, build_prompt
from compactd.worker.compaction.pruning import PruneAction
from compactd.worker.compaction.triggers import Pressure, measure, should_compact
from compactd.worker.compaction.validation import NO_HISTORY_SUMMARY, validate_summary

__all__ = [
    "NO_HISTORY_SUMMARY", "Clause", "Piece", "Plan", "Policy", "PolicyError", "Pressure",
    "PruneAction", "SummarizeStep", "SummaryCall", "build_prompt", "checkpoint_for", "measure",
    "parse_policy", "plan", "replan_smaller", "should_compact", "validate_summary",
]
