"""The real app in Debian chromium, attached to the real demo runtime.

Starts ``python -m runtime.tools.demo`` recording into a temporary database and
``streamlit run app.py`` on a free port, then drives the page: charts render,
the live region refreshes on its own, a max batch size set in the UI reaches the
runtime and the next batches follow it, and a snapshot downloads and re-opens.

Streamlit redraws the page on every run (and the live region every refresh), keeping
the previous run's elements on show, marked stale, until the new ones arrive. Each step
therefore waits for a settled page (no run in progress, nothing stale) before it reads or
clicks, and every locator names exactly one element.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime

import pytest

from batchscope.storage import control
from batchscope.presentation import snapshot
from batchscope.trace import check
from batchscope.storage.db import make_engine
from sqlalchemy import text

from runtime.tools.screenshots import DRAWN_CHARTS, ScreenshotError, go_to_batch, wait_for
from tests.browser import ARTIFACTS, MARKS, ROOT, opened_page, settle, stop
from tests.factories import free_port

pytestmark = MARKS
#: the app's local time zone (UTC+05:30 all year)
APP_TZ = "Asia/Kolkata"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("browser")
    url = f"sqlite:///{base / 'live.db'}"
    engine = make_engine(url)
    env = {**os.environ, "BATCHSCOPE_DB_URL": url, "BATCHSCOPE_NO_DEMO": "1"}
    runtime = subprocess.Popen([sys.executable, "-m", "runtime.tools.demo", "--db", url, "--port", "0",
                                "--intensity", "0.5"], cwd=ROOT, env=env,
                               stdout=open(base / "runtime.log", "wb"), stderr=subprocess.STDOUT)
    port = free_port()
    # the app's clock is not UTC (nor a whole hour off it): the page's times, and the names
    # of its downloads, must follow it
    app = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port",
                            str(port), "--server.headless", "true"], cwd=ROOT,
                           env={**env, "TZ": APP_TZ},
                           stdout=open(base / "app.log", "wb"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: control.live_instances(engine, now=time.time()), 60, "the demo runtime")
        wait_for(lambda: _batches(engine, "encoder") > 5, 60, "recorded batches")
        yield {"engine": engine, "url": f"http://127.0.0.1:{port}", "base": base}
    finally:
        stop(app)
        stop(runtime)
        engine.dispose()


def _batches(engine, model: str, after: float = 0.0, max_size: int | None = None) -> int:
    sql = "SELECT COUNT(*) FROM batches WHERE model = :m AND started_at > :t"
    if max_size is not None:
        sql += " AND max_batch_size = :s AND batch_size <= :s"
    with engine.connect() as conn:
        return conn.execute(text(sql), {"m": model, "t": after, "s": max_size}).scalar()


@pytest.fixture(scope="module")
def page(stack):
    with opened_page(stack["url"], height=1800, end_shot="dashboard-end.png") as pg:
        yield pg


def go_to(page, title: str, shows) -> None:
    """Open the page ``title`` from the top navigation; wait until it shows ``shows``."""
    from playwright.sync_api import expect
    link = page.get_by_test_id("stTopNav").get_by_role("link", name=title, exact=True)
    link.click()
    expect(link).to_have_attribute("aria-current", "page")
    shows.wait_for(timeout=60_000)
    settle(page)


def plots(page) -> int:
    return page.locator(".js-plotly-plot").count()


def test_charts_render_and_live_region_updates(page):
    wait_for(lambda: plots(page) >= 8, 90, "the charts")
    caption = page.get_by_test_id("stCaptionContainer").filter(
        has_text=re.compile(r"· refreshed "))

    def refreshed() -> str:
        settle(page)
        return caption.inner_text()
    first = refreshed()
    wait_for(lambda: refreshed() != first, 20, "a live refresh without input")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)


def _open_tab(page) -> str:
    settle(page)
    return page.get_by_test_id("stMain").locator("[role=tab][aria-selected=true]").inner_text()


def test_the_diagnosis_tab_stays_open_across_refreshes_and_models(page):
    """The tabs were known by their labels, "Diagnosis (7)" among them: each change of
    the count (and a page run for another model) showed Charts again."""
    tab = page.get_by_role("tab", name="Diagnosis", exact=True)
    tab.wait_for(timeout=60_000)
    settle(page)
    tab.click()
    wait_for(lambda: _open_tab(page) == "Diagnosis", 30, "the Diagnosis tab open")
    caption = page.get_by_test_id("stCaptionContainer").filter(
        has_text=re.compile(r"· refreshed "))

    def refreshed() -> str:
        settle(page)
        return caption.inner_text()
    for _ in range(3):  # live refreshes, each re-reading the findings
        before = refreshed()
        wait_for(lambda: refreshed() != before, 30, "a live refresh")
        assert _open_tab(page) == "Diagnosis"
    page.get_by_test_id("stSidebar").get_by_role("combobox", name="Model", exact=True).click()
    page.get_by_role("option", name="mlp", exact=True).click()
    page.get_by_test_id("stCaptionContainer").filter(has_text="model mlp").wait_for()
    assert _open_tab(page) == "Diagnosis"
    page.get_by_role("tab", name="Charts", exact=True).click()  # as the next tests expect
    wait_for(lambda: _open_tab(page) == "Charts", 30, "the Charts tab open")


def test_max_batch_size_from_the_ui_reaches_the_runtime(page, stack):
    engine = stack["engine"]
    settle(page)
    page.get_by_test_id("stSidebar").get_by_role("combobox", name="Model", exact=True).click()
    page.get_by_role("option", name="encoder", exact=True).click()
    page.get_by_test_id("stCaptionContainer").filter(has_text="model encoder").wait_for()
    settle(page)
    box = page.get_by_label("Max batch size", exact=True)
    go_to(page, "Tuning", box)
    box.fill("3")
    page.get_by_role("button", name="Apply", exact=True).click()
    try:
        page.get_by_text("applied as settings version", exact=False).wait_for(timeout=45_000)
    except Exception:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "tuning-failure.png"), full_page=True)
        raise AssertionError(f"no applied status; commands: "
                             f"{control.recent_commands(engine, model='encoder')}") from None
    cmd = control.recent_commands(engine, model="encoder")[0]
    assert cmd.status == "applied" and cmd.changes.get("max_batch_size") == 3
    # without a reload, the header and the history follow (they kept the old version, and
    # no history, until something else rebuilt the page)
    page.get_by_test_id("stCaptionContainer").filter(
        has_text=re.compile(rf"Current settings of encoder on .*, version {cmd.applied_version}$")
    ).wait_for(timeout=30_000)
    change = page.get_by_role("combobox", name="Change", exact=True)
    newest = re.compile(rf"^v{cmd.applied_version} at .*: max_batch_size \d+ → 3$")

    def first_change() -> str:  # the picker appears with the first recorded change
        settle(page)
        return change.evaluate("e => e.value || e.textContent || ''") if change.count() else ""
    wait_for(lambda: newest.match(first_change()), 30, "the change first in the history")
    # the batches after the change follow the new maximum
    wait_for(lambda: _batches(engine, "encoder", cmd.handled_at, max_size=3) >= 3, 60,
             "batches with the new max batch size")
    with engine.connect() as conn:
        bigger = conn.execute(text("SELECT COUNT(*) FROM batches WHERE model='encoder' AND "
                                   "started_at > :t + 0.5 AND batch_size > 3"),
                              {"t": cmd.handled_at}).scalar()
    assert bigger == 0


def test_timeline_shows_a_picked_batch_and_downloads_its_trace(page, stack):
    go_to(page, "Batch timeline", page.get_by_text("Slowest requests in the window"))
    wait_for(lambda: plots(page) >= 1, 60, "the batch timeline")
    with stack["engine"].connect() as conn:
        seq = conn.execute(text("SELECT seq FROM batches WHERE model = 'encoder' "
                                "ORDER BY ended_at DESC LIMIT 1")).scalar()
    go_to_batch(page, seq, 120)
    settle(page)
    assert plots(page) >= 2  # the timeline and the batch's requests
    page.screenshot(path=str(ARTIFACTS / "timeline.png"), full_page=True)
    caption = page.get_by_test_id("stCaptionContainer").filter(
        has_text=re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d → ")).inner_text()
    with page.expect_download(timeout=60_000) as dl:
        page.get_by_role("button", name="Download Perfetto trace").click()
    # named by the window's start on the page's clock (the caption's), with its UTC offset
    start = datetime.strptime(caption[:19], "%Y-%m-%d %H:%M:%S")
    assert dl.value.suggested_filename == f"batchscope-{start:%Y%m%dT%H%M%S}+0530.pftrace", \
        (dl.value.suggested_filename, caption)
    path = stack["base"] / "window.pftrace"
    dl.value.save_as(str(path))
    read = check.read_perfetto(path.read_bytes())
    assert read.ok, read.problems
    batches = [s for s in read.slices if s.category == "batch"]
    assert batches and any(s.args.get("seq") == seq for s in batches), \
        sorted({k for s in batches for k in s.args})


#: the middle batch of the timeline chart: its seq and where it is on the screen
#: the Batch timeline's own plot (the one whose points carry batch keys), not whichever
#: plot comes first: while Streamlit replaces the chart's element on a refresh, the picked
#: batch's member chart below it can be the page's first plot for a moment
TIMELINE_PLOT = ("Array.from(document.querySelectorAll('.js-plotly-plot')).find(g => "
                 "g._fullData && g._fullData.some(t => (t.customdata || []).some("
                 "c => Array.isArray(c) && c.length === 2)))")

MIDDLE_BATCH = """() => {
    const g = """ + TIMELINE_PLOT + """;
    if (!g || !g._fullData) return null;
    const box = g.getBoundingClientRect(), fl = g._fullLayout;
    for (const t of g._fullData) {
        const keys = (t.customdata || []).map((c, i) => [c, i])
            .filter(([c]) => Array.isArray(c) && c.length === 2 && c[1] >= 0);
        if (!keys.length) continue;
        const [key, i] = keys[Math.floor(keys.length / 2)];
        const xa = fl['xaxis' + (t.xaxis || 'x').slice(1)];
        const ya = fl['yaxis' + (t.yaxis || 'y').slice(1)];
        window.__clicked_figure = g.data;  // replaced by the next refresh's figure
        return {x: box.left + xa._offset + xa.d2p(t.x[i]), y: box.top + ya._offset + ya.d2p(t.y[i]),
                seq: key[1]};
    }
    return null;
}"""
#: whether the chart still holds the figure MIDDLE_BATCH read
SAME_FIGURE = "() => (" + TIMELINE_PLOT + " || {}).data === window.__clicked_figure"


def _follow_button(page) -> str | None:
    """"on" when the window follows the clock (the page offers to stop it), "off" when
    the page offers to follow, once settled; None while it shows neither."""
    settle(page)

    def shown(name: str) -> bool:  # a button of an older run may linger, hidden
        return any(b.is_visible() for b in page.get_by_role("button", name=name).all())
    if shown("Stop following"):
        return "on"
    return "off" if shown("Follow live") else None


def _follows(page) -> bool:
    return wait_for(lambda: _follow_button(page), 30, "the Follow live button") == "on"


def _following(page) -> None:
    """Start following the clock (a pick stopped it); wait until the page follows."""
    if not _follows(page):
        page.get_by_role("button", name="Follow live").locator("visible=true").click()
    wait_for(lambda: _follow_button(page) == "on", 30, "the window following the clock")
    page.get_by_text("· live: ends", exact=False).first.wait_for()
    settle(page)


def _shown(page, seq: int) -> bool:
    return bool(re.search(rf"\bBatch {seq} ·", page.get_by_test_id("stMain").inner_text()))


def test_picks_land_while_the_window_follows_the_clock(page, stack):
    """Live (the default), a timer run of the region may land while a pick is handled:
    every batch number typed must still show its batch and stop following (a timer run
    sent with the page's old state used to start following again). A click is aimed at a
    chart that a refresh may move under it, so clicks are counted: five must land, before
    fifteen miss."""
    go_to(page, "Batch timeline", page.get_by_text("Slowest requests in the window"))
    engine = stack["engine"]
    box = page.get_by_label("Go to batch number")

    def recent() -> list[int] | None:  # five recent batches, one apart, none the box holds
        with engine.connect() as conn:
            found = conn.execute(text("SELECT seq FROM batches WHERE model = 'encoder' AND "
                                      "ended_at < :t ORDER BY ended_at DESC LIMIT 12"),
                                 {"t": time.time() - 2}).scalars().all()
        found = [q for q in found if str(q) != box.input_value().strip()][::2][:5]
        return found if len(found) == 5 else None
    seqs = wait_for(recent, 60, "five recorded encoder batches")
    typed = 0
    for seq in seqs:
        _following(page)
        box.fill(str(seq))
        box.press("Enter")  # once: no retyping
        wait_for(lambda: _shown(page, seq) and not _follows(page), 30,
                 f"batch {seq} typed: shown, the window stopped")
        typed += 1
    assert typed == 5
    landed = missed = 0
    while landed < 5:
        assert missed < 15, f"{landed} of {landed + missed} clicks on a bar picked it"
        _following(page)
        page.wait_for_function(DRAWN_CHARTS, arg=1, timeout=30_000)
        target = wait_for(lambda: page.evaluate(MIDDLE_BATCH), 30, "a batch on the chart")
        page.mouse.click(target["x"], target["y"])
        if not page.evaluate(SAME_FIGURE):  # a refresh replaced the chart around the click
            missed += 1
            continue
        try:  # a refresh may still move the bars between the click and its event
            wait_for(lambda: _shown(page, target["seq"]) and not _follows(page), 10,
                     f"batch {target['seq']} clicked: shown, the window stopped")
        except ScreenshotError:
            missed += 1
            continue
        landed += 1


#: the timeline chart's x range as the browser shows it (a zoom changes it)
X_RANGE = "() => " + TIMELINE_PLOT + "._fullLayout.xaxis.range.slice()"
#: a batch in the x range shown, ``at`` (0-1) of the way through those at least 12 px from
#: any other batch's point (a click picks the nearest point: a neighbour 2 px away may be
#: it): its seq and where it is on the screen
SHOWN_BATCH = """(at) => {
    const g = """ + TIMELINE_PLOT + """;
    if (!g || !g._fullLayout) return {seq: null, points: 0};
    const box = g.getBoundingClientRect(), fl = g._fullLayout;
    const [lo, hi] = fl.xaxis.range;
    const points = [];
    for (const t of g._fullData) {
        const xa = fl['xaxis' + (t.xaxis || 'x').slice(1)];
        const ya = fl['yaxis' + (t.yaxis || 'y').slice(1)];
        (t.customdata || []).forEach((c, i) => {
            if (Array.isArray(c) && c.length === 2 && c[1] >= 0 && t.x[i] > lo && t.x[i] < hi)
                points.push({x: box.left + xa._offset + xa.d2p(t.x[i]),
                             y: box.top + ya._offset + ya.d2p(t.y[i]), seq: c[1]});
        });
    }
    // a click at a point's centre picks it where no other lies within a few pixels
    // (plotly picks the nearest); batches that run back to back on a busy machine lie
    // some 10 px apart in a zoomed window, so a wider margin could leave none
    const apart = points.filter(p => points.every(
        q => q === p || Math.hypot(q.x - p.x, q.y - p.y) >= 5));
    if (!apart.length) return {seq: null, points: points.length};
    apart.sort((a, b) => a.x - b.x);
    return apart[Math.min(apart.length - 1, Math.floor(apart.length * at))];
}"""


def test_a_zoom_survives_picks_by_click(page, stack):
    """In a stopped window a user zooms in, then clicks bars: each click picks its batch
    and the chart keeps the zoom (an outline drawn for the pick changed the figure, and
    Streamlit drew the chart afresh, showing the whole window again)."""
    go_to(page, "Batch timeline", page.get_by_text("Slowest requests in the window"))
    wait_for(lambda: _batches(stack["engine"], "encoder", time.time() - 8) >= 12, 60,
             "a dozen encoder batches in the last 8 s")
    _following(page)  # from the live edge, the window now holds them
    page.get_by_role("button", name="Stop following").locator("visible=true").click()
    wait_for(lambda: _follow_button(page) == "off", 30, "the window stopped")
    page.wait_for_function(DRAWN_CHARTS, arg=1, timeout=30_000)
    settle(page)
    whole = page.evaluate(X_RANGE)
    plot = page.locator(".js-plotly-plot", has_text="Batch timeline").locator(
        ".nsewdrag").first.bounding_box()
    y = plot["y"] + plot["height"] / 2
    page.mouse.move(plot["x"] + plot["width"] * 0.25, y)  # a plain drag zooms
    page.mouse.down()
    page.mouse.move(plot["x"] + plot["width"] * 0.75, y, steps=8)
    page.mouse.up()
    zoomed = wait_for(lambda: (r := page.evaluate(X_RANGE)) != whole and r, 10, "the zoom")
    assert zoomed[1] - zoomed[0] < (whole[1] - whole[0]) * 0.6, (whole, zoomed)
    picked: list[int] = []
    for at in (0.5, 0.0, 1.0):
        target = wait_for(lambda: (t := page.evaluate(SHOWN_BATCH, at))["seq"] is not None
                          and t, 30, "a batch in the zoomed range apart from the others")
        assert target["seq"] not in picked, \
            f"fewer than 3 batches apart from the others in the zoomed range: {picked}"
        # a click within plotly's double-click time (300 ms) of the last release would
        # make a double click, which shows the whole window again
        time.sleep(0.6)
        page.mouse.click(target["x"], target["y"])
        wait_for(lambda: _shown(page, target["seq"]), 30, f"batch {target['seq']} clicked")
        settle(page)
        picked.append(target["seq"])
        assert page.evaluate(X_RANGE) == zoomed, f"the zoom was lost after picking {picked}"
    page.screenshot(path=str(ARTIFACTS / "timeline_zoomed_pick.png"))


def test_snapshot_downloads_and_reopens(page, stack):
    prepare = page.get_by_role("button", name="Prepare snapshot of the current window", exact=True)
    go_to(page, "Snapshots", prepare)
    prepare.click()
    button = page.get_by_role("button", name="Download snapshot", exact=True)
    button.wait_for(timeout=60_000)
    settle(page)
    with page.expect_download(timeout=30_000) as dl:
        button.click()
    path = stack["base"] / "downloaded.zip"
    dl.value.save_as(str(path))
    snap = snapshot.load_snapshot(path)
    try:
        assert snap.manifest["tables"]["batches"]["rows"] > 0
    finally:
        snap.close()
    page.get_by_test_id("stFileUploaderDropzoneInput").set_input_files(str(path))
    # opening a snapshot switches the page to browse it
    page.get_by_text("Browsing snapshot downloaded.zip", exact=False).wait_for(timeout=60_000)
    settle(page)
    go_to(page, "Live", page.get_by_text("Browsing snapshot downloaded.zip", exact=False))
    wait_for(lambda: plots(page) >= 8, 60, "snapshot charts")

