"""``worker.compaction`` is pure: it imports no queue, database, cache, HTTP or model SDK."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import compactd.worker.compaction
from tests.support.source import parse_file

BANNED = ("celery", "kombu", "sqlalchemy", "alembic", "asyncpg", "aiosqlite", "redis", "httpx",
          "requests", "aiohttp", "openai", "anthropic")
PACKAGE = Path(compactd.worker.compaction.__file__).parent

PROBE = """
import importlib, pkgutil, sys
BANNED = set(sys.argv[1].split(","))

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BANNED:
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Blocker())
for name in BANNED:
    sys.modules.pop(name, None)
import compactd.worker.compaction
package = compactd.worker.compaction
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BANNED)
assert not leaked, leaked
print("clean")
"""


def test_imports_with_io_modules_blocked():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", PROBE, ",".join(BANNED)], cwd=root,
                          capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(root), "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"


def test_no_module_names_a_banned_import_even_lazily():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = parse_file(path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [(path.name, n) for n in names if n.split(".")[0] in BANNED]
    assert offenders == []
