"""The arrows point down: the import-linter contracts of pyproject.toml ([tool.importlinter])
hold. Here rather than as a step of ops/test, so that ``python -m pytest`` alone catches an
import that breaks them (ops/test runs pytest, so it runs them too)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept() -> None:
    # A child process with this checkout first on its path: the venv's editable install may
    # point at another one. No cache: a stale graph must never pass.
    result = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as run; run()",
         "--no-cache", "--no-logo"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    # The contracts were read, not an empty configuration passed.
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout)
    assert kept and int(kept.group(1)) >= 3, result.stdout
