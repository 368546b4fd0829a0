"""The Batch timeline page: which requests were batched together, and why one waited.

A window of the scope (10 s by default, 1 s to 5 min, never longer than the sidebar's
window nor past now; live windows follow the clock until a batch is picked) is read row by
row (``queries.timeline``) and drawn as lanes of batches (``presentation.timeline_chart``).
A batch is picked by clicking its bar, by a row of the "slowest requests" table, or by
its number; its requests are then drawn as queue wait and compute, with their table. The
window downloads as a Perfetto trace or as Chrome trace JSON (made when the button is
pressed, off the page's run), the same file a snapshot of the window holds.

Until a batch is picked, only the requests the chart marks or the table lists are read
(refused, expired, bypassed, the slowest), so the page's cost follows the batches, not the
requests: 10 s at 10,000 requests a second is about 3,000 batches. A window holding more
than ``PAGE_MAX_ROWS`` of those rows is refused with its row count and the length that
would fit.

Where the window ends is decided once per page run (:func:`window_end`, a pure function)
and written to ``timeline_end`` before the region reads it, so a region that finds it moved
(a pick did it) reruns the page once and never again for the same state. Times are the
dashboard's local time (``scope.fmt_time``), their zone named wherever one is shown; the
trace downloads are named by the window's start on that clock, with its UTC offset.
"""

from __future__ import annotations

import functools
import io
import time
from datetime import datetime, tzinfo
from typing import NamedTuple

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from batchscope.analysis.queries import Window
from batchscope.analysis.queries.timeline import (TimelineRows, WindowTooLarge, find_batch,
                                                  timeline_rows, with_members)
from batchscope.dashboard.scope import Scope, data_engine, fmt_time
from batchscope.presentation import timeline_chart
from batchscope.presentation.snapshot.layout import TRACE_MAX_ROWS

LENGTHS_S = (1, 2, 5, 10, 30, 60, 300)
DEFAULT_LENGTH_S = 10
#: the most batches and requests one page run reads (10 s at 10,000 requests/s is 100,000)
PAGE_MAX_ROWS = 400_000
SELECTED = "timeline_selected"
FOLLOW = "timeline_follow"
END = "timeline_end"
#: the slowest-requests table's key, and the count that renews it to clear a stale tick
TABLE = "timeline_slowest"
TABLE_GEN = "timeline_slowest_gen"
#: the largest batch number a database holds (a 64-bit integer)
MAX_SEQ = 2**63 - 1


class WindowEnd(NamedTuple):
    """Where the timeline's window lies (see :func:`window_end`)."""

    #: where it ends, never after now nor after the sidebar's window
    end_s: float
    #: its length: the one picked, or the sidebar's window's when that is shorter
    length_s: float
    #: the range the "Window ends at" slider offers; None when the window cannot move
    bounds: tuple[float, float] | None


def window_end(start_s: float, end_s: float, length_s: float, now: float,
               wanted_s: float | None) -> WindowEnd:
    """Where a window of ``length_s`` ends inside the sidebar's window ``start_s``..``end_s``
    (a live one passes ``end_s=now``): at ``wanted_s`` kept inside it, at its end when
    nothing is wanted. A window longer than the sidebar's is cut to it; one with under a
    second of room has no slider and ends where the sidebar's does."""
    hi = min(end_s, now)
    length = max(0.0, min(length_s, hi - start_s))
    lo = start_s + length
    if hi - lo < 1.0:
        return WindowEnd(hi, length, None)
    end = hi if wanted_s is None else min(max(wanted_s, lo), hi)
    return WindowEnd(end, length, (lo, hi))


def stale_tick(picks: list[tuple[str, object]], ticked: list[int],
               selected: tuple[str, int] | None) -> bool:
    """Whether the slowest-requests table's ticked row (``ticked``: its row numbers) no
    longer names the batch shown: the table holds no such row, the row's batch (``picks``:
    each row's instance and batch key, None/NaN without one) is not ``selected``, or
    nothing is. Such a tick is cleared, so a tick always marks the batch drawn."""
    if not ticked:
        return False
    if ticked[0] >= len(picks):
        return True
    inst, pick = picks[ticked[0]]
    if pick is None or pd.isna(pick) or selected is None:
        return True
    return (str(inst), int(pick)) != (str(selected[0]), int(selected[1]))


def parse_batch_number(text: str) -> int | None:
    """The batch number typed, or None when it is not a whole number >= 0 written with
    the digits 0-9 (as ``-5``, ``abc``, ``1.5`` or ``²`` are not)."""
    text = text.strip()
    if not text or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def zone(t: float) -> str:
    """The name of the local time zone at ``t`` (e.g. ``EST``), the zone ``fmt_time`` uses."""
    return timeline_chart.moment(t, None).tzname() or "local time"


def trace_file_name(start_s: float, suffix: str, tz: tzinfo | None = None) -> str:
    """The name a trace download of a window starting at ``start_s`` gets: the start on the
    page's clock (``tz``; None: the local zone, the caption's, axis's and slider's) with
    its UTC offset, which tells the same wall-clock time in two zones apart:
    ``batchscope-20261205T221503+0100.pftrace``."""
    return f"batchscope-{timeline_chart.moment(start_s, tz):%Y%m%dT%H%M%S%z}{suffix}"


def _as_end(t: float) -> datetime:
    """``t`` as the "Window ends at" slider holds it: local wall-clock time (naive), so
    that it shows the dashboard's clock."""
    return datetime.fromtimestamp(t)


def render(scope: Scope) -> None:
    engine = data_engine(scope)
    left, mid, right = st.columns([1, 3, 1])
    length = left.selectbox("Window", LENGTHS_S, index=LENGTHS_S.index(DEFAULT_LENGTH_S),
                            format_func=lambda s: f"{s} s", key="timeline_length")
    if FOLLOW not in st.session_state or not scope.live:
        st.session_state[FOLLOW] = scope.live
    follow = right.toggle("Follow live", key=FOLLOW, disabled=not scope.live,
                          help="the window ends now and moves with the clock; picking a batch "
                               "stops it where it is")
    now = time.time()
    w = scope.window(now)  # a live one moved to end now
    kept = st.session_state.get(END)
    # a snapshot's window is its data's, whatever this machine's clock says
    at = window_end(w.start_s, w.end_s, float(length), now if scope.snapshot is None else w.end_s,
                    None if kept is None else kept.timestamp())
    if at.length_s < length:
        mid.caption(f"The sidebar's time window is {at.length_s:.0f} s, shorter than {length} s: "
                    "the timeline shows all of it. Choose a longer time window in the sidebar "
                    "to see more.")
    if scope.live and follow:
        end_s = None
    elif at.bounds is None:  # no room to move: no slider, and the end is settled here
        st.session_state[END] = _as_end(at.end_s)
        end_s = at.end_s
    else:
        end_s = _end_slider(mid, at)
    st.fragment(run_every=scope.refresh_s if end_s is None else None)(region)(
        engine, scope, at.length_s, end_s)


def _end_slider(where, at: WindowEnd) -> float:
    """Where the window ends: a slider over ``at.bounds`` (one-second steps, local time)."""
    lo, hi = at.bounds
    st.session_state[END] = _as_end(at.end_s)  # the end settled on, before the slider
    picked = where.slider(f"Window ends at ({zone(hi)})", min_value=_as_end(lo),
                          max_value=_as_end(hi), step=pd.Timedelta(seconds=1),
                          format="HH:mm:ss", key=END)
    return picked.timestamp()


def region(engine: Engine, scope: Scope, length_s: float, end_s: float | None) -> None:
    if end_s is None and not st.session_state.get(FOLLOW):  # a pick stopped following
        st.rerun(scope="app")
    wanted = st.session_state.get(END)
    # render wrote the end it settled on to END, so only a pick since (a callback) differs
    if end_s is not None and wanted is not None and abs(wanted.timestamp() - end_s) >= 1.0:
        st.rerun(scope="app")  # a pick moved the window: the slider outside must follow
    end = time.time() if end_s is None else end_s
    w = Window(end - length_s, end, scope.model, scope.instance)
    st.session_state["timeline_window_end"] = end
    t = time.perf_counter()
    try:
        rows = timeline_rows(engine, w, max_rows=PAGE_MAX_ROWS, requests="marks")
        selected = _selected(rows)
        if selected is not None:
            rows = with_members(engine, rows, selected)
    except WindowTooLarge as exc:
        st.warning(f"{exc}.")
        return
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    fig = timeline_chart.timeline(rows, selected=selected, tz=None)
    build_s = time.perf_counter() - t
    st.caption(f"{fmt_time(w.start_s)} → {fmt_time(w.end_s)} {zone(w.end_s)} · model "
               f"{w.model or 'all'} · "
               f"{len(rows.batches):,} batches, {rows.requests_in_window:,} requests, "
               f"{len(rows.steps):,} steps · read {1000 * read_s:.0f} ms, drawn "
               f"{1000 * build_s:.0f} ms")
    for note in rows.notes if not rows.empty else ():  # an empty chart says so itself
        st.info(note)
    st.plotly_chart(fig, key="timeline_chart", on_select=_picked_on_chart,
                    selection_mode=("points", "box"), config={"displaylogo": False})
    _downloads(engine, w, len(rows.batches) + rows.requests_in_window)
    chosen, slow = st.columns([3, 2])
    with slow:
        st.markdown("**Slowest requests in the window**")
        table = timeline_chart.slowest(rows)
        key = _table_key(table, selected)
        st.dataframe(table.drop(columns=["instance_id", "pick"]), key=key,
                     on_select=functools.partial(_picked_in_table, key),
                     selection_mode="single-row", hide_index=True,
                     column_config={"finished": st.column_config.NumberColumn(
                         "finished (s)", format="%.3f"),
                         "latency_ms": st.column_config.NumberColumn(format="%.2f"),
                         "queue_ms": st.column_config.NumberColumn(format="%.2f"),
                         "compute_ms": st.column_config.NumberColumn(format="%.2f")})
        st.session_state["timeline_slowest_rows"] = table[["instance_id", "pick"]]
        st.text_input("Go to batch number", key="timeline_batch_number",
                      on_change=_picked_by_number, args=(engine, scope, length_s),
                      placeholder="e.g. 1234")
    with chosen:
        if selected is None:
            st.info("Pick a batch: click its bar (or choose the box select tool above the "
                    "chart and drag a box around it; a plain drag zooms), pick one of the "
                    "slowest requests, or type its number.")
        else:
            _show_selected(rows, selected)


def _selected(rows: TimelineRows) -> tuple[str, int] | None:
    """The picked batch when it is in the window, else None."""
    key = st.session_state.get(SELECTED)
    if key is None:
        return None
    inst, seq = key
    if seq >= 0:
        b = rows.batches
        found = ((b["instance_id"] == inst) & (b["seq"] == seq)).any()
    else:
        s = rows.steps
        found = ((s["instance_id"] == inst) & (s["id"] == -seq)).any()
    return key if found else None


def _table_key(table: pd.DataFrame, selected: tuple[str, int] | None) -> str:
    """The slowest-requests table's key: renewed (which clears its tick) when the row
    ticked no longer names the batch shown, as after a pick by the chart or by number."""
    gen = st.session_state.get(TABLE_GEN, 0)
    key = TABLE if gen == 0 else f"{TABLE}_{gen}"
    state = st.session_state.get(key)
    try:
        ticked = list(state["selection"]["rows"]) if state is not None else []
    except (KeyError, TypeError):
        ticked = []
    if stale_tick(list(zip(table["instance_id"], table["pick"])), ticked, selected):
        st.session_state[TABLE_GEN] = gen = gen + 1
        key = f"{TABLE}_{gen}"
    return key


def _pick(inst: str, seq: int) -> None:
    """Show batch ``seq`` of ``inst``; a window following the clock stops where it is."""
    st.session_state[SELECTED] = (str(inst), int(seq))
    if st.session_state.get(FOLLOW):
        st.session_state[FOLLOW] = False
        end = st.session_state.get("timeline_window_end", time.time())
        st.session_state[END] = _as_end(end)


def _picked_on_chart() -> None:
    points = st.session_state["timeline_chart"].selection.get("points", [])
    for p in points:
        data = p.get("customdata")
        if data is not None and len(data) == 2:
            _pick(data[0], int(data[1]))
            return


def _picked_in_table(key: str) -> None:
    picked = st.session_state[key].selection.get("rows", [])
    table = st.session_state.get("timeline_slowest_rows")
    if picked and table is not None and picked[0] < len(table):
        inst, seq = table.iloc[picked[0]]
        if pd.isna(seq):
            st.toast("the batch this request ran in is not in the window")
        else:
            _pick(inst, int(seq))


def _picked_by_number(engine: Engine, scope: Scope, length_s: float) -> None:
    """Go to the batch typed: the window stops following and centres on it."""
    text = st.session_state.get("timeline_batch_number", "").strip()
    if not text:  # the box was emptied
        return
    seq = parse_batch_number(text)
    if seq is None:
        st.toast(f"a batch number is a whole number ≥ 0, not {text[:40]!r}")
        return
    found = None if seq > MAX_SEQ else find_batch(engine, seq, model=scope.model,
                                                  instance_id=scope.instance)
    if found is None:
        st.toast(f"there is no batch {text} in this database"
                 + (f" for {scope.model}" if scope.model else ""))
        return
    if float(found["started_at"]) < scope.start_s:
        st.toast(f"batch {text} ran before the time window the sidebar sets; choose a longer "
                 "window (or a custom one) to go to it")
        return
    if not scope.live and float(found["started_at"]) >= scope.end_s:
        st.toast(f"batch {text} ran after the time window the sidebar sets; end that window "
                 "later to go to it")
        return
    _pick(found["instance_id"], seq)
    st.session_state[FOLLOW] = False
    st.session_state[END] = _as_end(float(found["ended_at"]) + length_s / 2)


def _show_selected(rows: TimelineRows, key: tuple[str, int]) -> None:
    fig, part = timeline_chart.members(rows, key)
    inst, seq = key
    if seq >= 0:
        b = rows.batches
        row = b[(b["instance_id"] == inst) & (b["seq"] == seq)].iloc[0]
        pad = 1 - row["real_elements"] / row["padded_elements"] if row["padded_elements"] else 0
        st.markdown(
            f"**Batch {seq}** · {row['model']} · {int(row['batch_size'])}/"
            f"{int(row['max_batch_size'])} · {row['policy']} · settings v"
            f"{int(row['settings_version'])} · {row['outcome']}"
            f"{' · CUDA graph' if row['cuda_graph'] else ''}  \n"
            f"compute {1000 * row['compute_s']:.2f} ms · queue wait "
            f"{1000 * row['queue_wait_min_s']:.2f}–{1000 * row['queue_wait_max_s']:.2f} ms · "
            f"bucket {'–' if pd.isna(row['bucket']) else int(row['bucket'])} · padding "
            f"{100 * pad:.0f}% · queue depth "
            f"{'–' if pd.isna(row['queue_depth']) else int(row['queue_depth'])}")
        oom = rows.batches[(rows.batches["instance_id"] == inst)
                           & (rows.batches["outcome"] == "oom")
                           & (rows.batches["ended_at"] <= row["started_at"] + 1e-9)
                           & (rows.batches["ended_at"] >= row["started_at"] - 1.0)]
        if len(oom):
            st.caption(f"{len(oom)} out-of-memory attempt(s) of this model ended in the second "
                       "before it started: the batch was split and retried")
    st.plotly_chart(fig, key="timeline_members", config={"displaylogo": False})
    if len(part):
        cols = [c for c in ("priority", "length", "outcome", "queue_wait_s", "latency_s",
                            "ttft_s", "prompt_tokens", "output_tokens", "bypass") if c in part]
        if "trace_id" in part and part["trace_id"].notna().any():  # its traced requests
            part = part.assign(receive_ms=1000 * (part["recv_end_at"] - part["recv_start_at"]),
                               send_ms=1000 * (part["send_end_at"] - part["send_start_at"]))
            cols += ["trace_id", "client_request_id", "receive_ms", "send_ms"]
        st.dataframe(part[cols].reset_index(drop=True), hide_index=True)


def _downloads(engine: Engine, w: Window, rows: int) -> None:
    """Download buttons for the window's trace, made on the click with the snapshot's
    limit (``TRACE_MAX_ROWS``), so that both give the same file; past it they are off,
    saying why. ``rows``: the window's batches and requests."""

    def made(fmt: str):
        def data() -> bytes:
            from batchscope.trace import export_trace
            buf = io.BytesIO()
            export_trace(engine, w, buf, fmt=fmt, max_rows=TRACE_MAX_ROWS)
            return buf.getvalue()
        return data

    off = rows > TRACE_MAX_ROWS
    a, b, why = st.columns([1, 1, 2])
    a.download_button("Download Perfetto trace", made("perfetto"),
                      file_name=trace_file_name(w.start_s, ".pftrace"),
                      mime="application/octet-stream", key="timeline_dl_perfetto",
                      on_click="ignore", help="open it in ui.perfetto.dev", disabled=off)
    b.download_button("Download Chrome trace", made("json"),
                      file_name=trace_file_name(w.start_s, ".json"), mime="application/json",
                      key="timeline_dl_json", on_click="ignore",
                      help="open it in chrome://tracing or ui.perfetto.dev", disabled=off)
    if off:
        why.caption(f"The window holds {rows:,} batches and requests, more than the "
                    f"{TRACE_MAX_ROWS:,} a trace download takes: pick a shorter window, or "
                    "export this one with `batchscope trace`.")
