"""What the browser tests share: Debian's chromium through Playwright, processes they
start and stop, and waits for a settled Streamlit page (every wait bounded)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from runtime.tools.screenshots import CHROMIUM, CHROMIUM_ARGS, opened, settle, stop
from tests.factories import wait_until

ROOT = Path(__file__).resolve().parent.parent
#: screenshots of the last page state (and of failures) go here
ARTIFACTS = Path(os.environ.get("BATCHSCOPE_BROWSER_ARTIFACTS",
                                ROOT / "benchmarks" / "results" / "browser"))
#: the marks of every browser test module
MARKS = [pytest.mark.browser, pytest.mark.slow,
         pytest.mark.skipif(not Path(CHROMIUM).exists(),
                            reason=f"{CHROMIUM} is absent (install Debian's chromium)")]
#: ``stop`` (a child process) and ``settle`` (a page) come from the screenshot script, which
#: drives the app the same way
__all__ = ["ARTIFACTS", "MARKS", "ROOT", "opened_page", "settle", "stop"]


@contextmanager
def opened_page(url: str, *, height: int, end_shot: str,
                start_limit: int = 240) -> Iterator:
    """A chromium page on the app at ``url``, settled; a screenshot ``end_shot`` at the end."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))
        pg = browser.new_page(viewport={"width": 1500, "height": height}, accept_downloads=True)
        pg.set_default_timeout(30_000)
        assert wait_until(lambda: opened(pg, url), start_limit, 0.25), "the Streamlit server"
        settle(pg)
        try:
            yield pg
        finally:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / end_shot), full_page=True)
            browser.close()
