"""The pure compaction policy: when to compact, what to prune and what to summarize, the summary
prompt, and whether a summary is acceptable.

Plain data in (surface nodes with token counts, a resolved policy, ``now``), plain data out (a
plan, prompts, a validation verdict). Nothing here imports Celery, SQLAlchemy, Redis or an HTTP or
model SDK, and nothing does I/O; ``tests/unit/test_compaction_imports.py`` holds that line.

Each part is imported from its own module (``planner.plan``, ``policy.parse_policy``,
``triggers.should_compact``, ``prompt.build_prompt``, ``validation.validate_summary``): this
package imports none of them, so a process that needs one (the configuration needs ``policy``
and ``lead``; every ``compactd`` command loads the configuration) does not pay for the rest.
"""
