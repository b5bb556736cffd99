"""``celery -A worker.app flower`` as an operator types it: no credentials, no start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_flower_refuses_to_start_without_authentication(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMPACTD_", "FLOWER_"))}
    env.update(PYTHONPATH=str(REPO), COMPACTD_HOME=str(tmp_path),
               # Nothing listens here: the refusal must come before any broker connection.
               COMPACTD_BROKER_URL="redis://127.0.0.1:9/0")
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "worker.app", "flower",
                          "--port=0", "--address=127.0.0.1"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Flower refuses to start without authentication" in out.stderr
    assert "FLOWER_BASIC_AUTH" in out.stderr
