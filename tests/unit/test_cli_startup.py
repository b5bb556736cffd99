"""What every CLI command pays before it runs: importing ``compactd.scheduler.cli`` loads no
module that only one command needs, nor one that only the worker needs."""

from __future__ import annotations

import subprocess
import sys

# Each loads a pipeline only its own command runs: eval the replay, demo the whole worker.
ONE_COMMAND_MODULES = ("compactd.scheduler.evaluate", "compactd.scheduler.demo")
# The worker's run and its metrics (prometheus_client): the client reached them through the
# webhooks it sends only when an overflow is served and webhooks are configured.
WORKER_ONLY_MODULES = ("compactd.worker.webhooks", "compactd.worker.run",
                       "compactd.worker.metrics", "prometheus_client")
# What a few commands need and the most frequent (ingest, surface, verify, status) do not: the
# planner (plan, and the client of compact, signal and delete), the status report, the
# providers check builds, the summary fallback with its retry library (tenacity), which
# the llm package's re-exports loaded with any of its modules, and the recall tools with the
# summary prompt they bring (history search and read, tools, and the client).
SOME_COMMANDS_MODULES = ("compactd.worker.compaction.planner", "compactd.scheduler.client",
                         "compactd.scheduler.status", "compactd.worker.llm.providers",
                         "compactd.worker.llm.fallback", "tenacity",
                         "compactd.worker.compaction.recall_tools",
                         "compactd.worker.compaction.recall",
                         "compactd.worker.compaction.prompt")


def test_importing_the_cli_leaves_each_one_command_module_to_its_command() -> None:
    modules = ONE_COMMAND_MODULES + WORKER_ONLY_MODULES + SOME_COMMANDS_MODULES
    code = ("import compactd.scheduler.cli, sys\n"
            f"loaded = [m for m in {modules!r}\n"
            "          if m in sys.modules]\n"
            "assert not loaded, f'imported with the CLI: {loaded}'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
