"""``compactd serve`` as a real process of a :class:`tests.support.stack.Stack`.

    url = start_api(stack)                      # port 0: the server picks a free one
    httpx.get(f"{url}/v1/sessions/s1", headers=bearer(TOKEN_A))

Two tenants, each with a bearer token read from the server's environment (``token_env``), so
the secrets never sit in the config file.
"""

from __future__ import annotations

import gc
import re
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import httpx
import yaml

from tests.support.stack import Process, Stack, wait_until

TOKEN_A = "tok-tenant-a-2f9c1e7d"
TOKEN_B = "tok-tenant-b-81b0a4c3"
TENANTS = {"tenant-a": ("COMPACTD_TEST_TOKEN_A", TOKEN_A),
           "tenant-b": ("COMPACTD_TEST_TOKEN_B", TOKEN_B)}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def launch_api(stack: Stack, name: str = "api", *, api: Mapping[str, Any] | None = None,
               env: Mapping[str, str] | None = None) -> Process:
    """Add an ``api:`` section to the stack's config and start the server (not waiting)."""
    config = yaml.safe_load(stack.config_path.read_text()) or {}
    config["api"] = {"tokens": [{"tenant": tenant, "token_env": token_env}
                                for tenant, (token_env, _) in TENANTS.items()], **(api or {})}
    stack.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return stack.start(name, [sys.executable, "-m", "compactd.scheduler.cli", "serve", "--port",
                              "0"],
                       env={**{token_env: token for token_env, token in TENANTS.values()},
                            **(env or {})})


def start_api(stack: Stack, name: str = "api", *, api: Mapping[str, Any] | None = None,
              timeout: float = 60.0) -> str:
    """Add an ``api:`` section to the stack's config, start the server, return its URL."""
    proc = launch_api(stack, name, api=api)
    found = wait_until(
        lambda: proc.poll() is not None
        or re.search(r"listening on (http://\S+)", stack.log(name)),
        timeout=timeout, what=f"{name} to listen")
    if proc.poll() is not None:
        raise AssertionError(f"{name} exited {proc.returncode}:\n{stack.log(name)[-3000:]}")
    assert isinstance(found, re.Match)
    return found.group(1)


def appends_while(url: str, token: str, session: str, busy: threading.Thread,
                  during: threading.Event) -> list[float]:
    """Append one short user message to ``session`` after another until ``busy`` ends; the
    seconds each append took that ended while ``during`` was set.

    The waits are the server's: this process's garbage collector is paused meanwhile. A full
    collection walks every object the test session holds (its imports, the other tests' leftovers)
    and stops every thread here for about as long as the bounds these waits are held to, so the
    append it lands in would count the client's pause as the server's."""
    took: list[float] = []
    gc.disable()
    try:
        with httpx.Client(base_url=url, headers=bearer(token), timeout=600) as http:
            n = 0
            while busy.is_alive():
                started = time.monotonic()
                step = http.post(f"/v1/sessions/{session}/messages",
                                 json={"messages": [{"role": "user", "content": f"b{n}"}]})
                assert step.status_code == 200, step.text
                if during.is_set():
                    took.append(time.monotonic() - started)
                n += 1
    finally:
        gc.enable()
    return took
