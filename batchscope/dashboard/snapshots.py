"""The Snapshots page: export the scope's window as a .zip, open snapshots, compare two.

An opened snapshot becomes a data source of its own (``Snapshot: <file name>`` under
Data in the sidebar); opening one switches the sidebar to it, so every page then browses
it instead of the live database.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import streamlit as st
from sqlalchemy import Engine

from batchscope.analysis import queries
from batchscope.dashboard.scope import Scope, browse_snapshot, data_engine, opened_snapshots
from batchscope.presentation import charts, report, snapshot

_ERRORS = "snap_errors"
_SEEN = "snap_uploads"
log = logging.getLogger(__name__)


def render(scope: Scope) -> None:
    export(data_engine(scope), scope)
    open_files()
    snaps = opened_snapshots()
    if len(snaps) >= 2:
        compare(snaps, scope.slo_ms)


def export(engine: Engine, scope: Scope) -> None:
    st.subheader("Export")
    st.caption("One .zip with the window's batches, requests, events, device samples, generation "
               "steps, settings, the flags found, the environment and an offline HTML report.")
    if st.button("Prepare snapshot of the current window", key="prep_snap"):
        with st.spinner("Exporting…"):
            st.session_state["snap_bytes"] = snapshot.export_bytes(
                engine, scope.window(time.time()), slo_ms=scope.slo_ms)
    data = st.session_state.get("snap_bytes")
    if data:
        st.download_button("Download snapshot", data, file_name="batchscope-snapshot.zip",
                           mime="application/zip", key="dl_snap")


def open_files() -> None:
    """Open uploaded snapshots once each, told apart by upload, not by name: a second file
    of a name already open (every export is ``batchscope-snapshot.zip``) opens as
    ``name (2)``. A file that fails keeps its error on show while it stays uploaded."""
    st.subheader("Open")
    files = st.file_uploader("Open snapshot(s) — two to compare", type=["zip"],
                             accept_multiple_files=True, key="upload")
    snaps = opened_snapshots()
    seen = st.session_state.setdefault(_SEEN, {})  # upload id -> the name it opened as
    errors = st.session_state.setdefault(_ERRORS, {})  # upload id -> (its name, why)
    opened = take_uploads(files or [], snaps, seen, errors, snapshot.load_snapshot)
    for name, err in errors.values():
        st.error(f"{name} was not opened: {err}")
    if opened is not None:
        browse_snapshot(opened)
        st.rerun()
    if snaps:
        st.caption("Opened: " + ", ".join(f"{name} (written by BatchScope "
                                          f"{snap.written_by or 'of an unknown version'})"
                                          for name, snap in snaps.items())
                   + " — pick one under Data in the sidebar.")


def take_uploads(files: list, snaps: dict, seen: dict, errors: dict,
                 load: Callable[[bytes], Any]) -> str | None:
    """Open each upload of ``files`` not met before (``seen``: upload id -> the name it
    opened as; ``errors``: upload id -> (file name, why it failed), an upload's error
    dropped once it is no longer uploaded) into ``snaps`` with ``load``; the name the
    last one opened as, None when none opened."""
    present = {f.file_id for f in files}
    for upload in [u for u in errors if u not in present]:
        del errors[upload]
    opened = None
    for f in files:
        if f.file_id in seen or f.file_id in errors:
            continue
        try:
            snap = load(f.getvalue())
        except snapshot.SnapshotError as exc:
            errors[f.file_id] = (f.name, str(exc))
            continue
        except Exception as exc:  # a bug, or the machine (memory, disk): still say so here
            errors[f.file_id] = (f.name, f"opening it failed unexpectedly "
                                         f"({type(exc).__name__}: {exc}); the dashboard's "
                                         "log has the details")
            log.exception("opening the snapshot %s failed", f.name)
            continue
        name = _free_name(f.name, snaps)
        snaps[name] = snap
        seen[f.file_id] = opened = name
    return opened


def _free_name(name: str, taken: dict) -> str:
    """``name``, or ``name (2)``, ``name (3)``, ... when a snapshot of that name is open."""
    if name not in taken:
        return name
    n = 2
    while f"{name} ({n})" in taken:
        n += 1
    return f"{name} ({n})"


def compare(snaps: dict[str, snapshot.Snapshot], slo_ms: float) -> None:
    st.subheader("Compare")
    names = list(snaps)
    c1, c2 = st.columns(2)
    a = c1.selectbox("Left", names, index=0, key="cmp_a")
    b = c2.selectbox("Right", names, index=1, key="cmp_b")
    bundles = {}
    for side, (col, name) in enumerate(((c1, a), (c2, b))):
        s = snaps[name]
        bundles[name] = queries.live_bundle(s.engine, s.window)
        with col:
            for label, value in report.headline_items(bundles[name]["headline"].iloc[0])[:6]:
                st.metric(label, value)
            st.plotly_chart(charts.latency(bundles[name]["requests_t"], bundles[name]["events"],
                                           slo_ms), key=f"cmp-lat-{side}")
    st.plotly_chart(charts.compare(bundles[a]["headline"], bundles[b]["headline"], labels=(a, b)),
                    key="cmp-bars")
