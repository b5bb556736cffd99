"""Flower in a real browser: Debian's chromium, headless, driven by Playwright (no downloaded
browser). A real worker and ``celery -A compactd.worker.app flower`` on Redis; a compaction fails
because every candidate answers whitespace; an operator logs in with basic auth and finds the failed
``compaction.run`` and its failure class on the tasks page. The screenshot is kept under
test-artifacts/ (gitignored).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from tests.conftest import REPO, missing
from tests.support.fake_provider import Behaviour
from tests.support.probes import free_port, http_status, query
from tests.support.services import debian_packages_settled
from tests.support.stack import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

CHROMIUM = "/usr/bin/chromium"
# Flags that work in containers and keep chromium from calling home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
USER, PASSWORD = "ops", "flower-test-password"
ARTIFACTS = REPO / "test-artifacts"
POLICY = {"trigger": [{"type": "tokens", "value": 4000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}


def _chromium() -> str:
    debian_packages_settled()
    if Path(CHROMIUM).exists() or shutil.which("chromium") == CHROMIUM:
        return CHROMIUM
    missing(f"{CHROMIUM} is missing (apt-get install chromium chromium-driver)")


def _flower_sees(url: str, worker: str) -> bool:
    """Flower's own metrics (unauthenticated) list a worker once its events reach Flower."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return False
    return re.search(rf'flower_worker_online\{{worker="{re.escape(worker)}@[^"]*"\}} 1\.0',
                     text) is not None


def test_flower_shows_the_failed_compaction_and_its_class(make_stack, fake, capsys) -> None:  # type: ignore[no-untyped-def]
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect, sync_playwright

    chromium = _chromium()
    stack = make_stack(claude=True, summarization=POLICY, default_model="fake-claude",
                       worker={"local_fallback": False})
    stack.ingest("s-flower", coding_session(steps=12, big_output_lines=30, seed=3).messages)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stack.start("flower", [sys.executable, "-m", "celery", "-A", "compactd.worker.app", "flower",
                           f"--port={port}", "--address=127.0.0.1"],
                env={"FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}"})
    wait_until(lambda: http_status(f"{url}/healthcheck") == 200 or stack.procs["flower"].poll()
               is not None, timeout=60, what="Flower to listen")
    assert stack.procs["flower"].poll() is None, stack.log("flower")[-3000:]
    stack.start_worker("w1", concurrency=2)
    wait_until(lambda: _flower_sees(url, "w1"), timeout=60, what="Flower to see the worker")

    # Basic auth is on: no credentials, wrong ones, right ones.
    assert http_status(f"{url}/tasks") == 401
    assert http_status(f"{url}/tasks", ("ops", "wrong")) == 401
    assert http_status(f"{url}/tasks", (USER, PASSWORD)) == 200

    # Every candidate (fake-gpt, then fake-claude) answers whitespace; no local fallback.
    fake.script(Behaviour(output="whitespace", times=-1))
    out = stack.cli("compact", "s-flower", "--wait", "--json", check=False)
    result = json.loads(out.stdout)
    assert out.returncode == 1 and result["failure_class"] == "summary", out.stdout
    assert [(c["candidate"], c["kind"]) for c in result["candidates"]] == [
        ("fake-gpt", "empty"), ("fake-claude", "empty")]
    (run,) = query(stack.database_url, lambda store: store.session_runs("s-flower"))
    assert run.failure_class == "summary" and run.task_id

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "flower-failed-compaction.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            # Without credentials the browser is challenged (headless chromium, which cannot
            # show a login dialog, fails the navigation instead of rendering the 401 page).
            anonymous = browser.new_context()
            try:
                response = anonymous.new_page().goto(f"{url}/tasks")
            except PlaywrightError as exc:
                assert "ERR_INVALID_AUTH_CREDENTIALS" in str(exc), exc
            else:
                assert response is not None and response.status == 401
            anonymous.close()

            context = browser.new_context(
                http_credentials={"username": USER, "password": PASSWORD},
                viewport={"width": 1600, "height": 900})
            page = context.new_page()
            response = page.goto(f"{url}/tasks")
            assert response is not None and response.status == 200
            row = page.locator("table#tasks-table tbody tr",
                               has_text="compaction.run").filter(has_text="FAILURE")
            expect(row).to_have_count(1, timeout=30_000)
            expect(row).to_contain_text("CompactionFailed")
            expect(row).to_contain_text("summary:")
            expect(row).to_contain_text("s-flower")
            expect(row).to_contain_text(run.task_id)
            page.screenshot(path=str(shot), full_page=True)
            # The task's own page (its uuid links there): the same failure, with its traceback.
            row.get_by_role("link", name=run.task_id).click()
            page.wait_for_url(f"**/task/{run.task_id}", timeout=15_000)
            body = page.locator("body")
            expect(body).to_contain_text("FAILURE", timeout=15_000)
            expect(body).to_contain_text("summary: every candidate failed on call 1 of 1")
            expect(body).to_contain_text("Traceback")
            expect(body).to_contain_text("w1@")
            # The client's task-sent event reached Flower too (task_send_sent_event).
            expect(page.get_by_text("Sent", exact=True)).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "flower-failed-compaction-task.png"),
                            full_page=True)
        finally:
            browser.close()
    with capsys.disabled():  # shown even when pytest captures output
        print(f"\nFlower screenshots: {shot}, {ARTIFACTS / 'flower-failed-compaction-task.png'}")
    assert shot.stat().st_size > 10_000
