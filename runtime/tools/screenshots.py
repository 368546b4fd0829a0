"""Screenshots of the dashboard for the docs, taken from the real app in a real browser.

    python -m runtime.tools.screenshots --out docs/images

Run it from a checkout (it needs ``app.py``), with the ``test`` extra installed (it drives
Debian's chromium through Playwright; ``playwright install`` is not needed). It starts the
bundled demo runtime recording into a temporary SQLite database and the dashboard
(``streamlit run app.py``) on free 127.0.0.1 ports, waits until the runtime has recorded
``--min-data-s`` seconds of traffic, and saves

- ``live.png``: the Live page of ``mlp`` over the last minute, live refresh paused so that
  no chart is caught half redrawn;
- ``timeline.png``: the Batch timeline page with the largest ``mlp`` batch picked.

The demo's traffic begins quiet, turns busy after 20 s and bursts at 50 s, so the default
``--min-data-s`` of 75 puts the burst inside the Live page's last minute.

Every wait polls for a row, an element or a text with a bounded timeout, so a run takes
as long as the data needs and fails with what it was waiting for.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync")
LIVE, TIMELINE = "live.png", "timeline.png"
#: the model both pages show
MODEL = "mlp"
#: true when no script or fragment run is in progress and no element of an older run is left
SETTLED = """() => {
    const app = document.querySelector('[data-testid="stApp"]');
    return app !== null && app.getAttribute("data-test-script-state") === "notRunning"
        && document.querySelector('[data-stale="true"]') === null;
}"""
#: how many drawn Plotly charts the page shows
DRAWN_CHARTS = "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class ScreenshotError(RuntimeError):
    """A wait ran out; the message says for what."""


#: how the shots are taken: name (``min_data_s`` is the flag ``--min-data-s``), default, help
OPTIONS = (("width", 1400, "viewport width (px)"), ("height", 900, "viewport height (px)"),
           ("min_data_s", 75.0, "seconds of recorded traffic before the first shot"),
           ("intensity", 1.0, "the demo's traffic, scaled"),
           ("timeout_s", 180.0, "the longest any one wait may take"),
           ("chromium", CHROMIUM, "the browser"))
DEFAULTS = {name: default for name, default, _ in OPTIONS}


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG file's header; ValueError when it is not a PNG."""
    head = Path(path).read_bytes()[:24]
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG file")
    return struct.unpack(">II", head[16:24])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    from runtime.server.service import bind_socket

    with bind_socket("127.0.0.1", 0) as sock:
        return sock.getsockname()[1]


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.25) -> Any:
    """Poll ``check`` until it gives something truthy (returned); ScreenshotError after
    ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise ScreenshotError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(step_s)


def stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` (kill it after 15 s) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextmanager
def process(argv: Sequence[str], log_path: Path, env: dict) -> Iterator[subprocess.Popen]:
    """A child process from the repository root, stopped on the way out."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop(proc)


def recorded_span_s(engine: Any) -> float:
    """Seconds between the first recorded batch's start and the last one's end."""
    from sqlalchemy import text

    with engine.connect() as conn:
        first, last = conn.execute(text("SELECT MIN(started_at), MAX(ended_at) "
                                        "FROM batches")).one()
    return 0.0 if first is None or last is None else float(last - first)


#: the batch shot on the timeline ended at most this long before the newest one (the page
#: shows the last minute; on a slow machine the Live shot alone can take longer)
RECENT_S = 20.0


def largest_batch(engine: Any, model: str) -> int | None:
    """The ``seq`` of ``model``'s largest batch among those of the last ``RECENT_S``
    seconds recorded (the newest of equals)."""
    from sqlalchemy import text

    with engine.connect() as conn:
        return conn.execute(text("SELECT seq FROM batches WHERE model = :m AND ended_at >= "
                                 "(SELECT MAX(ended_at) FROM batches WHERE model = :m) - :s "
                                 "ORDER BY batch_size DESC, ended_at DESC LIMIT 1"),
                            {"m": model, "s": RECENT_S}).scalar()


def opened(page: Any, url: str) -> bool:
    """Whether ``page`` could load ``url`` (False while the server is still starting)."""
    try:
        page.goto(url, timeout=5_000)
        return True
    except Exception:  # the server is still starting
        return False


def settle(page: Any, timeout_s: float = 120.0) -> None:
    """Wait until Streamlit finished its current run and nothing stale is shown."""
    page.wait_for_function(SETTLED, timeout=timeout_s * 1000, polling=100)


def go_to_batch(page: Any, seq: int, timeout_s: float, try_s: float = 20.0) -> None:
    """Type ``seq`` into the Batch timeline's "Go to batch number" and wait until its
    requests are drawn. A live run of the page that lands between typing and Enter can
    swallow the number, so it is typed again every ``try_s`` until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    box = page.get_by_label("Go to batch number")
    drawn = page.get_by_text(f"Batch {seq}:", exact=False).first
    while True:
        settle(page, max(1.0, deadline - time.monotonic()))
        box.fill(str(seq))
        box.press("Enter")
        left = deadline - time.monotonic()
        try:
            drawn.wait_for(timeout=max(1.0, min(try_s, left)) * 1000)
            return
        except Exception:
            if time.monotonic() + 1.0 >= deadline:
                raise ScreenshotError(f"timed out after {timeout_s:.0f} s waiting for batch "
                                      f"{seq} to be drawn") from None


def scroll_to_top(locator: Any) -> None:
    """Scroll the page so that ``locator``'s element is at the top of the viewport."""
    locator.evaluate("el => el.scrollIntoView({block: 'start'})")


def shoot_live(page: Any, path: Path, timeout_s: float) -> None:
    """The Live page of ``MODEL`` over the last minute, refresh paused, from its
    headline numbers down."""
    sidebar = page.get_by_test_id("stSidebar")
    sidebar.get_by_role("combobox", name="Model", exact=True).click()
    page.get_by_role("option", name=MODEL, exact=True).click()
    captions = page.get_by_test_id("stCaptionContainer")
    captions.filter(has_text=f"model {MODEL}").first.wait_for(timeout=timeout_s * 1000)
    settle(page, timeout_s)
    sidebar.get_by_text("1 min", exact=True).click()
    settle(page, timeout_s)
    sidebar.get_by_text("Pause live refresh", exact=True).click()
    settle(page, timeout_s)
    page.wait_for_function(DRAWN_CHARTS, arg=4, timeout=timeout_s * 1000, polling=200)
    settle(page, timeout_s)
    scroll_to_top(captions.filter(has_text="· refreshed ").first)
    page.screenshot(path=str(path))


def shoot_timeline(page: Any, path: Path, seq: int, timeout_s: float) -> None:
    """The Batch timeline page with batch ``seq`` picked, from the top."""
    link = page.get_by_test_id("stTopNav").get_by_role("link", name="Batch timeline",
                                                       exact=True)
    link.click()
    page.get_by_text("Slowest requests in the window").wait_for(timeout=timeout_s * 1000)
    settle(page, timeout_s)
    go_to_batch(page, seq, timeout_s)
    settle(page, timeout_s)
    page.wait_for_function(DRAWN_CHARTS, arg=2, timeout=timeout_s * 1000, polling=200)
    scroll_to_top(page.get_by_test_id("stTopNav"))
    page.screenshot(path=str(path))


def take(out: Path, **options: Any) -> list[Path]:
    """Start the demo runtime and the app, save ``live.png`` and ``timeline.png`` in
    ``out``; their paths. ``options``: those of ``OPTIONS`` that differ from the defaults."""
    from playwright.sync_api import sync_playwright

    from batchscope.storage import control
    from batchscope.storage.db import make_engine

    if not (ROOT / "app.py").exists():
        raise ScreenshotError(f"no app.py in {ROOT}: run this from a checkout of BatchScope")
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"take() has no option {sorted(unknown)}")
    opt = {**DEFAULTS, **options}
    timeout_s, min_data_s = opt["timeout_s"], opt["min_data_s"]
    with ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchscope-shots-")))
        url = f"sqlite:///{base / 'demo.db'}"
        engine = make_engine(url)
        stack.callback(engine.dispose)
        env = {**os.environ, "BATCHSCOPE_DB_URL": url, "BATCHSCOPE_NO_DEMO": "1"}
        stack.enter_context(process(
            [sys.executable, "-m", "runtime.tools.demo", "--db", url, "--port", "0",
             "--intensity", str(opt["intensity"])], base / "runtime.log", env))
        port = free_port()
        stack.enter_context(process(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
             "--server.headless", "true"], base / "app.log", env))
        wait_for(lambda: control.live_instances(engine, now=time.time()), timeout_s,
                 "the demo runtime to report")
        wait_for(lambda: recorded_span_s(engine) >= min_data_s, timeout_s + min_data_s,
                 f"{min_data_s:.0f} s of recorded batches")
        wait_for(lambda: largest_batch(engine, MODEL), timeout_s, f"a batch of {MODEL}")
        pw = stack.enter_context(sync_playwright())
        browser = pw.chromium.launch(executable_path=opt["chromium"], args=list(CHROMIUM_ARGS))
        stack.callback(browser.close)
        page = browser.new_page(viewport={"width": opt["width"], "height": opt["height"]},
                                device_scale_factor=1, color_scheme="light")
        page.set_default_timeout(timeout_s * 1000)
        wait_for(lambda: opened(page, f"http://127.0.0.1:{port}"), timeout_s,
                 "the dashboard to answer")
        settle(page, timeout_s)
        shoot_live(page, out / LIVE, timeout_s)
        seq = largest_batch(engine, MODEL)  # picked now: still inside the page's window
        shoot_timeline(page, out / TIMELINE, int(seq), timeout_s)
    return [out / LIVE, out / TIMELINE]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime.tools.screenshots",
                                     description="Screenshots of the Live and Batch timeline "
                                                 "pages for the docs, from the real app.")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images",
                        help="folder for live.png and timeline.png (default docs/images)")
    for name, default, text in OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=f"{text} (default {default})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        paths = take(args.out, **{name: getattr(args, name) for name in DEFAULTS})
    except ScreenshotError as exc:
        print(f"screenshots: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        w, h = png_size(path)
        print(f"wrote {path} ({w}x{h}, {path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
