"""What the dashboard looks at: the ``Scope`` every page receives, built from the sidebar.

The entry script (``app.py``) calls :func:`from_sidebar` once per run, which draws the
database, data source, instance, model, time window, SLO and refresh pickers and returns
a frozen :class:`Scope`. :func:`remember` keeps it for the page that runs next, which
reads it back with :func:`current`. Pages never read the sidebar widgets themselves.

The data source is either the live database (``Scope.snapshot`` is None) or a snapshot
opened on the Snapshots page; :func:`data_engine` gives the engine to query for either.

The Database URL box is open to whoever reaches the dashboard, so what it accepts is
narrow (:func:`vet_database_url`). The configured database (``BATCHSCOPE_DB_URL``, the
secret of that name, else ``data/batchscope.db``) is the operator's choice and is
opened as a runtime opens it, created when missing. Anything else typed there must be
a SQLite file that already holds a BatchScope database: other database URLs (a server
on the network), in-memory databases, URL options, folders, other files and SQLite
databases that are not BatchScope's are refused, and nothing is created, no folder, no
file, no table. A new database file is made only when the visitor ticks "Create a new
database there", and only as a ``.db``/``.sqlite``/``.sqlite3`` file in a folder that
exists. A refused URL is said so under the box and the configured database is shown.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from batchscope.analysis import queries
from batchscope.presentation import snapshot
from batchscope.storage import control, db

WINDOWS_MIN = {"1 min": 1.0, "5 min": 5.0, "15 min": 15.0, "60 min": 60.0}
LIVE_SOURCE = "Live database"
SNAPSHOT_PREFIX = "Snapshot: "
#: seconds between the checks that rebuild the page when runtimes or models come and go
WATCH_EVERY_S = 2.0

_SCOPE_KEY = "scope"
_SNAPSHOTS_KEY = "snapshots"
_SWITCH_KEY = "switch_source"
_CREATE_KEY = "db_create"
#: file names a new database may be created under from the Database URL box
NEW_DB_SUFFIXES = (".db", ".sqlite", ".sqlite3")
_SQLITE_HEADER = b"SQLite format 3\x00"


@dataclass(frozen=True)
class Scope:
    """The database, filters and time window of one page run."""

    db_url: str
    #: the instance to look at; None means every instance
    instance: str | None
    #: the model to look at; None while no model has reported
    model: str | None
    #: the time window in wall-clock seconds, as of when the scope was built
    start_s: float
    end_s: float
    #: the window ends now and slides with the clock (False for a past window or a snapshot)
    live: bool
    #: the name of the opened snapshot being browsed; None for the live database
    snapshot: str | None
    slo_ms: float
    #: seconds between live refreshes; None when not live or paused
    refresh_s: float | None = None
    #: runtimes reporting when the scope was built, and those among them that are the demo
    live_ids: tuple[str, ...] = ()
    demo_ids: tuple[str, ...] = ()
    #: the models the Model picker offered
    models: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def window(self, now: float) -> queries.Window:
        """The query window; a live one is moved to end at ``now``."""
        if self.live:
            return queries.Window(now - self.duration_s, now, self.model, self.instance)
        return queries.Window(self.start_s, self.end_s, self.model, self.instance)


# -- resources and state ----------------------------------------------------------------
@st.cache_resource(show_spinner=False)
def engine_for(url: str) -> Engine:
    """One engine per database URL and Streamlit server process. The configured database
    is created when missing (as a runtime would); any other URL only reaches here once
    :func:`vet_database_url` accepted it, and is opened without creating anything."""
    try:
        if url == default_db_url():
            return db.make_engine(db.bounded_url(url))
        engine = db.make_engine(db.bounded_url(url), create=False)
        db.init_schema(engine)  # a BatchScope database of an older version: upgrade it
        return engine
    except db.SchemaTooNew as exc:  # written by a newer release: say so, touch nothing
        st.error(str(exc))
        st.stop()
        raise
    except (db.DatabaseUnavailable, SQLAlchemyError, OSError) as exc:  # not reachable
        where = db.shown_url(url)
        reason = getattr(exc, "orig", None) or exc
        st.error(f"The database at {where} cannot be opened: {str(reason).strip()}. Check "
                 "that its server runs and the URL is right, or type another URL under "
                 "Database URL in the sidebar.")
        st.stop()
        raise


def read_trouble(exc: OperationalError) -> str:
    """What a page says when a read of its database failed: a lock held longer than the
    reader waits (SQLite's busy timeout, PostgreSQL's ``lock_timeout``:
    ``db.bounded_url``), or a server that does not answer; and what to do."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    first = (text.splitlines()[0] if text else type(exc).__name__)[:300]
    waited = db.lock_waited_s(first)
    if waited is not None:
        return (f"The database is busy: another program held a lock on it for longer than "
                f"the {waited:g} s a page waits ({first}). A schema migration or a long "
                "write does that; the page reads again at its next refresh, or press R.")
    return (f"The database could not be read ({first}). Check that its server runs and "
            "answers; the page reads again at its next refresh, or press R.")


@contextlib.contextmanager
def reads_guarded():
    """Run a page (or a region of one) so that a failed read of its database
    (``OperationalError``: locked, unreachable) is said in one line on the page, not
    as a stack trace; the rest of that page or region is left out of this run."""
    try:
        yield
    except OperationalError as exc:
        st.error(read_trouble(exc))


def fragment(region, run_every: float | None):
    """``region`` as a Streamlit fragment, rerun every ``run_every`` seconds (None: with
    its page), each run under :func:`reads_guarded`, so a refresh that cannot read says
    why. Every live region of the dashboard is made here."""
    @functools.wraps(region)  # the fragment's identity: the region's module and name
    def run(*args, **kwargs):
        with reads_guarded():
            return region(*args, **kwargs)
    return st.fragment(run_every=run_every)(run)


def vet_database_url(url: str, *, create: bool = False) -> str | None:
    """Why ``url``, typed in the Database URL box, is refused; None when it may be opened.

    The configured database is always accepted. Anything else must be a plain SQLite
    file URL naming an existing BatchScope database, or, with ``create``, a missing
    ``.db``/``.sqlite``/``.sqlite3`` file in an existing folder, which is then created
    (owner-only, with the schema). See the module docstring for why."""
    if url == default_db_url():
        return None
    path = db.sqlite_path(url)
    if path is None or "?" in url:
        return (f"{url!r:.200} is not a SQLite database file URL (sqlite:///path/to/file.db, "
                "without options); other databases are chosen with BATCHSCOPE_DB_URL when the "
                "dashboard starts")
    where = Path(os.path.abspath(path))
    if not where.exists():
        return _create_database(url, where) if create else (
            f"there is no database at {where}; tick 'Create a new database there' to make one, "
            "or check the path")
    if not where.is_file():
        return f"{where} is not a file"
    why = _not_batchscope(where)
    if why is None:
        return None
    if create and where.stat().st_size == 0:  # an empty file is an empty SQLite database
        return _create_database(url, where)
    return why


def _not_batchscope(path: Path) -> str | None:
    """Why the file at ``path`` is not a BatchScope database; None when it is one. Opened
    read-write without the create flag, so a file that goes away is not made anew."""
    try:
        with open(path, "rb") as fh:
            header = fh.read(len(_SQLITE_HEADER))
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    if header != _SQLITE_HEADER:
        return f"{path} is not a SQLite database"
    try:
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=rw", uri=True, timeout=db.BUSY_TIMEOUT_S)
    except sqlite3.Error as exc:
        return f"{path} cannot be opened: {exc}"
    try:
        row = conn.execute("SELECT value FROM schema_meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.Error:
        row = None
    finally:
        conn.close()
    if row is None:
        return (f"{path} is a SQLite database but not a BatchScope one; point the box at the "
                "file a runtime records into (its --db)")
    return None


def _create_database(url: str, path: Path) -> str | None:
    """Make a new BatchScope database at ``path`` (the visitor asked for it): only a
    database file name, only in a folder that exists."""
    if path.suffix not in NEW_DB_SUFFIXES:
        return (f"a new database file must be named *{', *'.join(NEW_DB_SUFFIXES)}; "
                f"{path.name!r} is not")
    if not path.parent.is_dir():
        return f"the folder {path.parent} does not exist; the dashboard does not create folders"
    try:
        db.make_engine(url).dispose()
    except Exception as exc:
        return f"a database could not be created at {path}: {exc}"
    return None


def opened_snapshots() -> dict[str, snapshot.Snapshot]:
    """The snapshots opened in this browser session, by file name."""
    return st.session_state.setdefault(_SNAPSHOTS_KEY, {})


def browse_snapshot(name: str) -> None:
    """Make the next run browse the opened snapshot ``name`` (call ``st.rerun`` after)."""
    st.session_state[_SWITCH_KEY] = SNAPSHOT_PREFIX + name


def data_engine(scope: Scope) -> Engine:
    """The engine holding the scope's data: the snapshot's, or the live database's."""
    if scope.snapshot is not None:
        return opened_snapshots()[scope.snapshot].engine
    return engine_for(scope.db_url)


def remember(scope: Scope) -> None:
    st.session_state[_SCOPE_KEY] = scope


def current() -> Scope:
    """The scope the entry script built for this run."""
    found = st.session_state.get(_SCOPE_KEY)
    if not isinstance(found, Scope):
        raise RuntimeError("the dashboard pages need the scope that app.py builds; start the "
                           "dashboard with `streamlit run app.py`, not a page file")
    return found


def fmt_time(seconds: float) -> str:
    """Wall-clock seconds as local time, the way every page shows times."""
    return dt.datetime.fromtimestamp(float(seconds)).strftime("%Y-%m-%d %H:%M:%S")


# -- the sidebar ------------------------------------------------------------------------
def default_db_url() -> str:
    """``BATCHSCOPE_DB_URL``, else the ``BATCHSCOPE_DB_URL`` secret, else the default file."""
    if os.environ.get(db.ENV_URL):
        return os.environ[db.ENV_URL]
    try:
        return str(st.secrets["BATCHSCOPE_DB_URL"])
    except (KeyError, FileNotFoundError, st.errors.StreamlitSecretNotFoundError):
        return db.default_url()


def from_sidebar() -> Scope:
    """Draw the scope pickers in the sidebar and return what they select."""
    sb = st.sidebar
    sb.title("BatchScope")
    configured = default_db_url()
    typed = sb.text_input("Database URL", value=configured, key="db_url").strip()
    create = False
    if typed != configured:
        create = sb.checkbox("Create a new database there", value=False, key=_CREATE_KEY,
                             help="Only for a .db/.sqlite/.sqlite3 file in a folder that exists")
    refused = vet_database_url(typed, create=create)
    url = typed
    if refused is not None:
        sb.error(f"Not opened: {refused}. Showing the configured database ({configured}).")
        url = configured
    snaps = opened_snapshots()
    if _SWITCH_KEY in st.session_state:  # a snapshot was just opened: browse it
        st.session_state["source"] = st.session_state.pop(_SWITCH_KEY)
    source = sb.radio("Data", [LIVE_SOURCE] + [SNAPSHOT_PREFIX + n for n in snaps], key="source")
    name = source[len(SNAPSHOT_PREFIX):] if source.startswith(SNAPSHOT_PREFIX) else None
    snap = snaps.get(name) if name is not None else None
    engine = snap.engine if snap is not None else engine_for(url)

    now = time.time()
    live_rows = control.live_instances(engine, now=now) if snap is None else []
    live_ids = tuple(i.id for i in live_rows)
    demo_ids = tuple(i.id for i in live_rows if (i.version or "").endswith("-demo"))
    inst_rows = queries.instances(engine)
    options = ["all"] + (list(inst_rows["id"]) if len(inst_rows) else [])
    default = options.index(live_ids[0]) if live_ids and live_ids[0] in options else 0
    inst = sb.selectbox("Instance", options, index=default, key="instance",
                        format_func=lambda i: i + (" (live)" if i in live_ids else ""))
    instance = None if inst == "all" else inst
    names = queries.models(engine, instance)
    # start on a batching model: its charts are the ones every view fills
    kinds = queries.model_kinds(engine, instance)
    first = next((i for i, n in enumerate(names) if kinds.get(n, "request") != "generate"), 0)
    picked = sb.selectbox("Model", names or ["(none yet)"], index=first, key="model")
    model = None if picked == "(none yet)" else picked

    if snap is not None:
        w = snap.window
        start, end, live = w.start_s, w.end_s, False
        sb.caption(f"Snapshot window: {fmt_time(start)} → {fmt_time(end)}")
    else:
        choice = sb.radio("Time window", list(WINDOWS_MIN) + ["custom"], index=2,
                          horizontal=True, key="window_choice")
        ago_min = 0.0
        if choice == "custom":
            minutes = sb.number_input("Window length (minutes)", 0.5, 24 * 60.0, 30.0,
                                      key="custom_min")
            ago_min = sb.number_input("Ending this many minutes ago", 0.0, 7 * 24 * 60.0, 0.0,
                                      key="custom_end")
        else:
            minutes = WINDOWS_MIN[choice]
        end = now - float(ago_min) * 60.0
        start, live = end - float(minutes) * 60.0, ago_min == 0.0

    slo_ms = sb.number_input("Latency SLO (ms)", 1.0, 600_000.0, 50.0, key="slo_ms")
    refresh_s = sb.select_slider("Refresh every (s)", [1.0, 1.5, 2.0], 2.0, key="refresh")
    paused = sb.toggle("Pause live refresh", value=False, key="paused")
    return Scope(db_url=url, instance=instance, model=model, start_s=start, end_s=end,
                 live=live, snapshot=name if snap is not None else None, slo_ms=float(slo_ms),
                 refresh_s=float(refresh_s) if live and not paused else None,
                 live_ids=live_ids, demo_ids=demo_ids, models=tuple(names))


def rerun_when_runtimes_change(scope: Scope) -> None:
    """Rebuild the whole page (sidebar included) when runtimes or models appear or go.

    The live view refreshes on its own, but the Instance and Model pickers are drawn once
    per page run and would otherwise keep showing "(none yet)" after a runtime (e.g. the
    auto-started demo) begins reporting. Run it as a fragment every ``WATCH_EVERY_S``.
    """
    engine = engine_for(scope.db_url)
    live_ids = tuple(i.id for i in control.live_instances(engine, now=time.time()))
    names = tuple(queries.models(engine, scope.instance))
    if live_ids != scope.live_ids or names != scope.models:
        st.rerun(scope="app")
