""""Find best settings" in the real app, in Debian chromium, against a real runtime.

Starts ``batchscope serve`` (a subprocess) with a toy model whose batches take 20 ms
whatever their size, recording into a temporary database, and ``streamlit run app.py``
on it. The runtime starts at ``max_batch_size`` 1, so every larger size serves several
times more under a generous SLO: a short session (a 15 s budget) finds a better point
whatever the seeded search tries first, and batches that sleep keep their timing on a
busy machine (the trial options judge windows leniently too). On the Tuning page the
test starts a session, watches the trials arrive,
applies the recommendation, and finds the session stored and listed with its
golden-parameter row, which downloads as CSV.

Streamlit redraws the page on every run; each step waits for a settled page (no run in
progress, nothing stale) before it reads or clicks, and every wait is bounded.
"""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.tuning import store
from batchscope.tuning.space import format_point
from tests.browser import ARTIFACTS, MARKS, ROOT, opened_page, settle, stop
from tests.factories import SLEEPY_MODEL, free_port, wait_until

INSTANCE = "tune-browser"
MODEL = "sleepy"

pytestmark = MARKS


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("browser-tuning")
    url = f"sqlite:///{base / 'live.db'}"
    engine = make_engine(url)
    (base / "sleepy.py").write_text(SLEEPY_MODEL)
    env = {**os.environ, "BATCHSCOPE_DB_URL": url, "BATCHSCOPE_NO_DEMO": "1"}
    runtime = subprocess.Popen(
        [sys.executable, "-m", "runtime.tools.cli", "serve", "--model", f"{base / 'sleepy.py'}:Sleepy",
         "--db", url, "--port", "0", "--instance-id", INSTANCE, "--heartbeat-interval-s", "0.5",
         "--policy", "dynamic", "--max-batch-size", "1"],
        cwd=ROOT, env=env, stdout=open(base / "runtime.log", "wb"), stderr=subprocess.STDOUT)
    port = free_port()
    app = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port",
                            str(port), "--server.headless", "true"], cwd=ROOT, env=env,
                           stdout=open(base / "app.log", "wb"), stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: any(i.id == INSTANCE and i.url for i in
                                      control.live_instances(engine, now=time.time())),
                          360, 0.25), f"the runtime did not register; see {base / 'runtime.log'}"
        assert wait_until(lambda: control.current_settings(engine, INSTANCE, MODEL), 120, 0.25)
        yield {"engine": engine, "url": f"http://127.0.0.1:{port}", "base": base}
    finally:
        stop(app)
        stop(runtime)
        engine.dispose()


@pytest.fixture(scope="module")
def page(stack):
    with opened_page(stack["url"], height=2400, end_shot="tuning-end.png") as pg:
        yield pg


@contextmanager
def step(page, stack, what: str):
    """On failure: a screenshot, and an error naming the step, the stored sessions and the
    end of the app's log."""
    try:
        yield
    except Exception as exc:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "tuning-failure.png"), full_page=True)
        log = (stack["base"] / "app.log").read_text(errors="replace")[-2000:]
        raise AssertionError(f"{what}: {type(exc).__name__}: {str(exc)[:500]}\nstored: "
                             f"{store.sessions(stack['engine'])}\napp log: {log}") from None


def test_find_best_settings_runs_applies_and_is_stored(page, stack):
    from playwright.sync_api import expect
    engine = stack["engine"]
    with step(page, stack, "opening the Tuning page"):
        page.get_by_test_id("stCaptionContainer").filter(has_text=f"model {MODEL}").wait_for(
            timeout=60_000)
        link = page.get_by_test_id("stTopNav").get_by_role("link", name="Tuning", exact=True)
        link.click()
        expect(link).to_have_attribute("aria-current", "page")
        start = page.get_by_role("button", name="Find best settings", exact=True)
        start.wait_for(timeout=60_000)
        settle(page)
    with step(page, stack, "starting a session"):
        page.get_by_label("SLO: p99 at most (ms)", exact=True).fill("2000")
        page.get_by_label("Budget (s)", exact=True).fill("15")
        page.get_by_label("Connections (closed loop)", exact=True).fill("8")
        # a shared test machine is noisy: short windows, judged leniently
        page.get_by_text("Trial options", exact=True).click()
        page.get_by_label("Measurement window (s)", exact=True).fill("0.5")
        page.get_by_label("Settle after a change (s)", exact=True).fill("0.2")
        page.get_by_label("Windows agree within (%)", exact=True).fill("60")
        start.click()
        page.get_by_role("button", name="Cancel the session", exact=True).wait_for(timeout=60_000)
    with step(page, stack, "watching the trials arrive"):  # the live region refreshes itself
        page.get_by_text(re.compile(r"^[1-9]\d* trial\(s\) measured; stored as tuning session #")
                         ).first.wait_for(timeout=60_000)
    with step(page, stack, "applying the recommendation"):
        page.get_by_text(re.compile(r"^Stopped: ")).wait_for(timeout=60_000)
        settle(page)
        apply = page.get_by_role("button", name=re.compile(r"^Apply max_batch_size=|^Apply policy="))
        apply.wait_for(timeout=30_000)
        label = apply.inner_text()
        apply.click()
        page.get_by_text("applied as settings version", exact=False).wait_for(timeout=45_000)
    cmd = control.recent_commands(engine, model=MODEL, limit=1)[0]
    assert cmd.requested_by == "tuner" and cmd.instance_id == INSTANCE and cmd.status == "applied"
    _, running = control.current_settings(engine, INSTANCE, MODEL)
    assert {k: running[k] for k in cmd.changes} == cmd.changes
    # the session is stored, listed on the page, and in the golden table
    [s] = store.sessions(engine)
    assert (s.state, s.instance_id, s.requested_by, s.model) == ("finished", INSTANCE, "dashboard", MODEL)
    assert s.trials >= 2 and s.recommended == cmd.changes
    assert label == f"Apply {format_point(s.recommended)}"
    with step(page, stack, "finding the stored session listed"):
        settle(page)
        page.get_by_text(f"1 stored session(s) of {MODEL}, newest first.").wait_for(timeout=30_000)
        shown = page.get_by_role("combobox", name="Session", exact=True).evaluate(
            "e => e.value || e.textContent || ''")
    assert shown.startswith(f"#{s.id} · {MODEL} ·") and shown.endswith("· finished"), shown
    with step(page, stack, "downloading the golden table"):
        download = page.get_by_role("button", name="Download CSV", exact=True)
        download.scroll_into_view_if_needed()
        with page.expect_download(timeout=30_000) as dl:
            download.click()
        text = Path(dl.value.path()).read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [(r["session"], r["model"]) for r in rows] == [(str(s.id), MODEL)]
    assert rows[0]["best batch size"] == str(s.best_settings["max_batch_size"])
    assert rows[0]["hardware"].startswith("CPU")
