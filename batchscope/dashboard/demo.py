"""The bundled demo runtime, started when nothing reports to the dashboard's database.

``python -m runtime.tools.demo`` runs as a child process of the Streamlit server, recording
synthetic, varying traffic into the database the dashboard reads; it stops when the server
exits. At most one is started per server process, and only into the configured database
(``BATCHSCOPE_DB_URL`` or the default), whatever visitors type in the Database URL box: a
demo must not fill someone's recorded data with synthetic traffic, nor a visitor start
processes by typing URLs. The dashboard only starts it by command line, so ``batchscope``
still never imports ``runtime``. ``BATCHSCOPE_NO_DEMO=1`` or the sidebar toggle turns it
off.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import streamlit as st

from batchscope.dashboard.scope import Scope, default_db_url

#: the checkout's root: the demo is run from there so ``runtime`` is importable
ROOT = Path(__file__).resolve().parents[2]
MODULE = "runtime.tools.demo"
LOG_PATH = Path(tempfile.gettempdir()) / "batchscope-demo-runtime.log"


def absolute_sqlite_url(url: str) -> str:
    """``url`` with a relative SQLite file path made absolute against the working folder
    (other URLs as they are): a child started in another folder opens the same file."""
    from sqlalchemy.engine import make_url

    from batchscope.storage.db import sqlite_path

    path = sqlite_path(url)
    if path is None or os.path.isabs(path):
        return url
    return make_url(url).set(database=os.path.abspath(path)).render_as_string(
        hide_password=False)


class DemoRuntime:
    """The demo runtime as a child process, stopped when the app exits."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = LOG_PATH
        source = ROOT / Path(*MODULE.split(".")).with_suffix(".py")
        if not source.exists():
            where = source.relative_to(ROOT)
            self.error = f"the demo runtime ({where}) is not part of this checkout"
            return
        self._log = open(self.log_path, "ab")
        # it runs in the checkout's root: a relative SQLite path is this process's
        target = absolute_sqlite_url(url)
        self.proc = subprocess.Popen(
            self.argv(target), cwd=str(ROOT), stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "BATCHSCOPE_DB_URL": target})
        atexit.register(self.stop)

    @staticmethod
    def argv(url: str) -> list[str]:
        """The command line that runs the demo runtime into ``url``."""
        return [sys.executable, "-m", MODULE, "--db", url, "--port", "0"]

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class DemoSlot:
    """The one demo runtime of a server process: started by the first ``get``, kept
    after (a demo that exited is not restarted; its log says why)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # sessions run in threads of their own
        self.runtime: DemoRuntime | None = None
        self.starts = 0

    def get(self, url: str) -> DemoRuntime:
        with self._lock:
            if self.runtime is None:
                self.starts += 1
                self.runtime = DemoRuntime(url)
            return self.runtime


@st.cache_resource(show_spinner=False)
def demo_slot() -> DemoSlot:
    """This server process's demo slot (one, whichever session asks)."""
    return DemoSlot()


def demo_runtime(url: str) -> DemoRuntime:
    """The server's demo runtime, started into ``url`` on the first call; later calls get
    the same one, whatever URL they name."""
    return demo_slot().get(url)


def allowed_from_sidebar() -> bool:
    """The sidebar toggle; it starts on unless ``BATCHSCOPE_NO_DEMO`` is set."""
    default = os.environ.get("BATCHSCOPE_NO_DEMO", "") not in ("1", "true", "yes")
    return st.sidebar.toggle("Start the demo runtime when nothing reports", value=default,
                             key="demo_on")


def show_source(scope: Scope, *, demo_allowed: bool) -> None:
    """Say where the data comes from, starting the demo runtime when nothing reports."""
    url = scope.db_url
    if scope.snapshot is not None:
        st.info(f"Browsing snapshot {scope.snapshot} (not live).")
    elif scope.live_ids and scope.demo_ids == scope.live_ids:
        ours = demo_slot().runtime
        if ours is not None and ours.running():
            why = (f", started by this dashboard because no other runtime was reporting to "
                   f"{url}. Turn it off with BATCHSCOPE_NO_DEMO=1 or the sidebar toggle.")
        else:  # python -m runtime.tools.demo, or another dashboard's
            why = f", reporting to {url} (started outside this dashboard)."
        st.info("Live data from the bundled demo runtime (models mlp, encoder and decoder under "
                f"synthetic, varying traffic){why}")
    elif scope.live_ids:
        st.caption(f"Attached to live runtime(s): {', '.join(scope.live_ids)}")
    elif demo_allowed and url != default_db_url():
        st.warning(f"No runtime is reporting to {url}; showing recorded data only (the demo "
                   "runtime only records into the dashboard's configured database, "
                   f"{default_db_url()}).")
    elif demo_allowed:
        demo = demo_runtime(url)
        if demo.url != url:  # the configuration changed since it was started
            st.warning(f"No runtime reports to {url}; the demo runtime of this dashboard "
                       f"records into {demo.url} (one is started per dashboard server).")
            return
        if demo.error:
            st.warning(f"No runtime reports to {url} and {demo.error}.")
        elif demo.running():
            st.info(f"No runtime was reporting to {url}, so the bundled demo runtime was "
                    f"started (pid {demo.proc.pid}) with synthetic traffic. Turn this off with "
                    "BATCHSCOPE_NO_DEMO=1 or the sidebar toggle.")
        else:
            st.error(f"The demo runtime exited; see {demo.log_path}.")
    else:
        st.warning(f"No runtime is reporting to {url}; showing recorded data only.")
