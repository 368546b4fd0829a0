"""What the browser tests share: Debian's chromium through Playwright, processes they
start and stop, and waits for a settled Streamlit page (every wait bounded)."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.factories import wait_until

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
#: screenshots of the last page state (and of failures) go here
ARTIFACTS = Path(os.environ.get("BATCHSCOPE_BROWSER_ARTIFACTS",
                                ROOT / "benchmarks" / "results" / "browser"))
#: the marks of every browser test module
MARKS = [pytest.mark.browser, pytest.mark.slow,
         pytest.mark.skipif(not Path(CHROMIUM).exists(),
                            reason=f"{CHROMIUM} is absent (install Debian's chromium)")]

#: true when no script or fragment run is in progress and no element of an older run is left
SETTLED = """() => {
    const app = document.querySelector('[data-testid="stApp"]');
    return app !== null && app.getAttribute("data-test-script-state") === "notRunning"
        && document.querySelector('[data-stale="true"]') === null;
}"""


def stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` (kill it after 15 s) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def settle(page, timeout_s: float = 60) -> None:
    """Wait until Streamlit finished its current run and nothing stale is shown."""
    page.wait_for_function(SETTLED, timeout=timeout_s * 1000, polling=100)


def _opened(page, url: str) -> bool:
    try:
        page.goto(url, timeout=5_000)
        return True
    except Exception:  # the server is still starting
        return False


@contextmanager
def opened_page(url: str, *, height: int, end_shot: str,
                start_limit: int = 240) -> Iterator:
    """A chromium page on the app at ``url``, settled; a screenshot ``end_shot`` at the end."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        pg = browser.new_page(viewport={"width": 1500, "height": height}, accept_downloads=True)
        pg.set_default_timeout(30_000)
        assert wait_until(lambda: _opened(pg, url), start_limit, 0.25), "the Streamlit server"
        settle(pg)
        try:
            yield pg
        finally:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / end_shot), full_page=True)
            browser.close()
