"""The Batch timeline page: which requests were batched together, and why one waited.

A window of the scope (10 s by default, 1 s to 5 min, never longer than the sidebar's
window nor past the live edge; live windows follow the clock until a batch is picked) is
read row by row (``queries.timeline``) and drawn as lanes of batches
(``presentation.timeline_chart``), of the sidebar's model or, with "Models: all models",
of every model. A batch is picked by clicking its bar, by a row of the "slowest requests"
table, or by its number; its requests are then drawn as queue wait and compute, with their
table. The window downloads as a Perfetto trace or as Chrome trace JSON (made when the
button is pressed, off the page's run), the same file a snapshot of the window holds.

Until a batch is picked, only the requests the chart marks or the table lists are read
(refused, expired, bypassed, the slowest), so the page's cost follows the batches, not the
requests: 10 s at 10,000 requests a second is about 3,000 batches. A window holding more
than ``PAGE_MAX_ROWS`` of those rows is refused with its row count and the length that
would fit.

Live, the window ends ``LIVE_LAG_S`` before now, once the recorder has written the rows
of its last moments, so the page counts what a download of the same window holds. The
live region (a fragment) refreshes every ``live_every_s``: the sidebar's refresh, or
``COST_FACTOR`` times what its last run took to read and draw when that is longer; a
window of more than ``LIVE_MAX_BARS`` batches and steps (its marked requests counted,
five to a batch) stops following, saying why (both in ``timeline_decisions``).

Following the clock is kept in ``FOLLOWING``, a key no widget owns, and started or
stopped with buttons: a timer run of the fragment sent while a pick is being handled
carries the browser's old widget values, and would switch a toggle that the pick turned
off back on (the pick then seemed ignored: the window kept moving). A button's click is
sent once and never again, so nothing but a click changes it. The batch number box is
drawn outside the fragment, so typing a number reruns the page once.

Where the window ends is decided once per page run (what the page decides is in
``batchscope.dashboard.timeline_decisions``, pure functions) and written to
``timeline_end`` before the region reads it, so a region that finds it moved (a pick did
it) reruns the page once and never again for the same state. A pick's message (a number
that names no batch, say) is kept in ``NOTE`` by its callback and shown on the page until
the next pick. A number the page could not go to is kept in ``NUMBER_TRIED`` with what it
was looked up in, for each page run to decide anew what holds now
(``timeline_decisions.number_again``).
"""

from __future__ import annotations

import functools
import io
import time
from datetime import datetime

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from batchscope.analysis.queries import Window
from batchscope.analysis.queries.timeline import (TimelineRows, WindowTooLarge, find_batch,
                                                  find_step, timeline_rows, with_members)
from batchscope.dashboard.scope import Scope, data_engine, fmt_time, fragment
from batchscope.dashboard.timeline_decisions import (
    COST_FACTOR, LIVE_LAG_S, RECORDER_FLUSH_S, NumberTried, WindowEnd, behind_edge_in_s,
    drawn_view, following_view, live_every_s, marked, not_found_note, number_again,
    outside_window_note, parse_batch_number, refresh_cost_s, stale_tick, step_header,
    step_sequences_note, stop_note, stop_note_shown, too_many_to_follow, trace_file_name,
    window_end, zone)
from batchscope.presentation import timeline_chart
from batchscope.presentation.snapshot.layout import TRACE_MAX_ROWS

LENGTHS_S = (1, 2, 5, 10, 30, 60, 300)
DEFAULT_LENGTH_S = 10
#: the most batches and requests one page run reads (10 s at 10,000 requests/s is 100,000)
PAGE_MAX_ROWS = 400_000
SELECTED = "timeline_selected"
#: whether the window follows the clock (no widget's key, see the module's docstring)
FOLLOWING = "timeline_following"
#: the keys of the buttons that start and stop following
FOLLOW = "timeline_follow"
STOP = "timeline_stop"
END = "timeline_end"
#: the end the last run of the region read up to
WINDOW_END = "timeline_window_end"
#: the chart the last run drew: (what it shows, ``drawn_view``; the batch it marks picked)
DRAWN = "timeline_drawn"
#: the batch last picked by a click on the chart, and the view clicked: (instance, seq, view)
CLICKED = "timeline_clicked"
NUMBER = "timeline_batch_number"
#: a number typed that the page could not go to (a :class:`NumberTried`): looked up again
#: once the model, instance or database changes, gone to once the sidebar's window holds it
NUMBER_TRIED = "timeline_number_tried"
MODELS = "timeline_models"
#: a pick's message: (where it is shown, "number" or "table"; the text)
NOTE = "timeline_note"
#: why the window stopped following by itself: (the view it stopped in, see
#: :func:`following_view`; the note)
STOP_NOTE = "timeline_stop_note"
#: the last region run's cost: ((length, model, instance), seconds); the cadence in effect
COST = "timeline_cost"
EVERY = "timeline_every"
#: the slowest-requests table's key, and the count that renews it to clear a stale tick
TABLE = "timeline_slowest"
TABLE_GEN = "timeline_slowest_gen"
#: the largest batch number a database holds (a 64-bit integer)
MAX_SEQ = 2**63 - 1


def find_numbered(engine: Engine, seq: int, model: str | None,
                  instance: str | None) -> dict | None:
    """Batch ``seq`` of ``model`` on ``instance`` (None: any), else a generation model's
    step ``seq``: its instance, model, start, end, ``kind`` ("batch" or "step") and
    ``key``, the (instance, seq) that picks it (a step's: ``-id``). A batch comes first
    where a request model's batch and a generation model's step share the number."""
    if seq > MAX_SEQ:
        return None
    found = find_batch(engine, seq, model=model, instance_id=instance)
    if found is not None:
        return {**found, "kind": "batch", "key": (str(found["instance_id"]), int(seq))}
    found = find_step(engine, seq, model=model, instance_id=instance)
    if found is not None:
        return {**found, "kind": "step", "key": (str(found["instance_id"]), -int(found["id"]))}
    return None


#: how every time in milliseconds is shown in the timeline's tables
MS_FORMAT = "%.2f"
#: the slowest-requests table's columns, in their order, with their names on the page: the
#: latency it is sorted by and the batch a row picks first, so both show on a laptop screen
SLOWEST_COLUMNS = {
    "latency_ms": st.column_config.NumberColumn("latency (ms)", format=MS_FORMAT),
    "batch": st.column_config.NumberColumn(
        "batch", format="%d", help="the batch the request ran in; a generation request's: "
                                   "the engine step it joined"),
    "batch_size": st.column_config.NumberColumn(
        "batch size", format="%d", help="the batch's size; a generation request's: the "
                                        "sequences running in the step it joined"),
    "queue_ms": st.column_config.NumberColumn("queue wait (ms)", format=MS_FORMAT),
    "compute_ms": st.column_config.NumberColumn(
        "start to answer (ms)", format=MS_FORMAT,
        help="latency less queue wait: from its batch's start to its answer, the batch's "
             "compute and the answer handed back (a batch's compute alone is in its header)"),
    "priority": st.column_config.NumberColumn("priority", format="%d"),
    "length": st.column_config.NumberColumn("length", format="%d"),
    "outcome": st.column_config.TextColumn("outcome"),
    "model": st.column_config.TextColumn("model"),
    "finished": st.column_config.NumberColumn("finished (s after the window's start)",
                                              format="%.3f"),
}
#: the picked batch's requests table: its column, its name on the page, times in ms
MEMBER_COLUMNS = (("priority", "priority", False), ("length", "length", False),
                  ("outcome", "outcome", False), ("queue_wait_s", "queue wait (ms)", True),
                  ("compute_s", "start to answer (ms)", True),
                  ("latency_s", "latency (ms)", True),
                  ("ttft_s", "first token (ms)", True), ("prompt_tokens", "prompt tokens", False),
                  ("output_tokens", "output tokens", False), ("bypass", "bypass", False))
#: columns a generation model's requests fill, shown only when one of them holds a value
GENERATION_COLUMNS = ("ttft_s", "prompt_tokens", "output_tokens")


def requests_table(part: pd.DataFrame) -> pd.DataFrame:
    """The picked batch's (or step's) requests as the page lists them: times in ms, as in
    its header and the slowest-requests table; a generation model's columns only where one
    holds a value; a traced request's trace id, client id, receive and send times only
    when one of them was traced."""
    p = part.reset_index(drop=True)
    if "queue_wait_s" in p and "latency_s" in p:
        p = p.assign(compute_s=p["latency_s"] - p["queue_wait_s"])
    out = pd.DataFrame(index=p.index)
    for col, name, ms in MEMBER_COLUMNS:
        if col not in p or (col in GENERATION_COLUMNS and not p[col].notna().any()):
            continue
        out[name] = 1000 * p[col].astype(float) if ms else p[col]
    if "trace_id" in p and p["trace_id"].notna().any():
        out["trace id"] = p["trace_id"]
        out["client request id"] = p["client_request_id"]
        out["receive (ms)"] = 1000 * (p["recv_end_at"] - p["recv_start_at"])
        out["send (ms)"] = 1000 * (p["send_end_at"] - p["send_start_at"])
    return out


def ms_columns(table: pd.DataFrame) -> dict:
    """Each "(ms)" column of ``table`` shown with two decimals, as in the slowest-requests
    table (the values keep their precision for sorting)."""
    return {name: st.column_config.NumberColumn(name, format=MS_FORMAT)
            for name in table.columns if name.endswith("(ms)")}


def _as_end(t: float) -> datetime:
    """``t`` as the "Window ends at" slider holds it: local wall-clock time (naive), so
    that it shows the dashboard's clock."""
    return datetime.fromtimestamp(t)


def render(scope: Scope) -> None:
    engine = data_engine(scope)
    left, models, mid, right = st.columns([1, 1.3, 3, 1.5])
    length = left.selectbox("Window", LENGTHS_S, index=LENGTHS_S.index(DEFAULT_LENGTH_S),
                            format_func=lambda s: f"{s} s", key="timeline_length")
    model = _models_choice(models, scope)
    edge = time.time() - LIVE_LAG_S  # the live edge: the recorder has written up to it
    w = scope.window(edge)  # a live one moved to end at the edge
    kept = st.session_state.get(END)
    # a snapshot's window is its data's, whatever this machine's clock says
    at = window_end(w.start_s, w.end_s, float(length),
                    edge if scope.snapshot is None else w.end_s,
                    None if kept is None else kept.timestamp())
    again = number_again(st.session_state.get(NUMBER_TRIED),
                         st.session_state.get(NUMBER, "").strip(), model, scope.instance,
                         _source(scope), scope.start_s, scope.end_s, scope.live)
    if again is not None and again.action is None:
        _say("number", again.note)  # said of the sidebar's window shown now
    elif again is not None:
        if again.action == "find":
            _picked_by_number(engine, scope, model, at.length_s)
        else:
            _go_to(st.session_state[NUMBER_TRIED].found, at.length_s)
        if NOTE not in st.session_state:
            st.rerun()  # it landed: the window moved to it
    following = _follow_button(right, scope)
    right.text_input("Go to batch number", key=NUMBER, on_change=_picked_by_number,
                     args=(engine, scope, model, at.length_s),
                     # no help: its button would share the box's label (the tests find it so)
                     placeholder="e.g. 1234 (a batch, or a step)")
    if at.length_s < length:
        mid.caption(f"The sidebar's time window is {at.length_s:.0f} s, shorter than {length} s: "
                    "the timeline shows all of it. Choose a longer time window in the sidebar "
                    "to see more.")
    if scope.live and following:
        end_s = None
    elif at.bounds is None:  # no room to move: no slider, and the end is settled here
        st.session_state[END] = _as_end(at.end_s)
        end_s = at.end_s
    else:
        end_s = _end_slider(mid, at)
    stopped = stop_note_shown(st.session_state.get(STOP_NOTE),
                              following_view(scope, model, at.length_s), scope.live)
    if stopped is None:  # said of another window, or one that cannot follow
        st.session_state.pop(STOP_NOTE, None)
    elif not following:
        mid.info(stopped)
    _show_note("number")
    every = _cadence(scope, model, at.length_s) if end_s is None else None
    st.session_state[EVERY] = every
    fragment(region, every)(engine, scope, model, at.length_s, end_s, every)


def _models_choice(where, scope: Scope) -> str | None:
    """The model the timeline shows: the sidebar's, or None for all (each in its lane)."""
    if scope.model is None:  # no model has reported: every model there is
        return None
    # fixed labels: a label that changed with the sidebar would lose the choice made
    choice = where.selectbox("Models", ("sidebar", "all"), key=MODELS,
                             format_func={"sidebar": "the sidebar's model",
                                          "all": "all models"}.get,
                             help="the model picked in the sidebar, or every model, each in "
                                  "a lane of its own (this page only)")
    return scope.model if choice == "sidebar" else None


def _follow_button(where, scope: Scope) -> bool:
    """Draw the button that starts or stops following the clock; whether it follows."""
    if FOLLOWING not in st.session_state or not scope.live:
        st.session_state[FOLLOWING] = scope.live
    following = bool(st.session_state[FOLLOWING])
    if following:
        where.button("Stop following", key=STOP, icon=":material/pause:",
                     on_click=_set_following, args=(False,),
                     help="the window follows the clock (ending now, less the recorder's "
                          "write delay); stop it where it is (picking a batch stops it too)")
    else:
        where.button("Follow live", key=FOLLOW, icon=":material/play_arrow:",
                     on_click=_set_following, args=(True,), disabled=not scope.live,
                     help="end the window now and move it with the clock"
                          if scope.live else "the sidebar's time window is not live")
    return following


def _set_following(following: bool) -> None:
    st.session_state[FOLLOWING] = following
    if following:
        st.session_state.pop(STOP_NOTE, None)
    elif WINDOW_END in st.session_state:  # stop where the live window was
        st.session_state[END] = _as_end(st.session_state[WINDOW_END])


def _cadence(scope: Scope, model: str | None, length_s: float) -> float | None:
    """Seconds between the live region's refreshes, from the cost of its last run in this
    view (window length, model, instance): :func:`live_every_s`."""
    cost = st.session_state.get(COST)
    view = (length_s, model, scope.instance)
    return live_every_s(scope.refresh_s, cost[1] if cost and cost[0] == view else None,
                        st.session_state.get(EVERY))


def _end_slider(where, at: WindowEnd) -> float:
    """Where the window ends: a slider over ``at.bounds`` (one-second steps, local time)."""
    lo, hi = at.bounds
    st.session_state[END] = _as_end(at.end_s)  # the end settled on, before the slider
    picked = where.slider(f"Window ends at ({zone(hi)})", min_value=_as_end(lo),
                          max_value=_as_end(hi), step=pd.Timedelta(seconds=1),
                          format="HH:mm:ss", key=END)
    return picked.timestamp()


def _show_note(where: str) -> None:
    """The message of the last pick, where it was made ("number" or "table")."""
    note = st.session_state.get(NOTE)
    if note is not None and note[0] == where:
        st.warning(note[1])


def _say(where: str, text: str) -> None:
    """Keep a pick's message for the page to show (a callback draws nothing itself)."""
    st.session_state[NOTE] = (where, text)


def region(engine: Engine, scope: Scope, model: str | None, length_s: float,
           end_s: float | None, every_s: float | None) -> None:
    following = end_s is None
    if following and not st.session_state.get(FOLLOWING):  # a pick stopped following
        st.rerun(scope="app")
    if following and _cadence(scope, model, length_s) != every_s:
        st.rerun(scope="app")  # the last run's cost changed the cadence: set it anew
    wanted = st.session_state.get(END)
    # render wrote the end it settled on to END, so only a pick since (a callback) differs
    if end_s is not None and wanted is not None and abs(wanted.timestamp() - end_s) >= 1.0:
        st.rerun(scope="app")  # a pick moved the window: the slider outside must follow
    end = time.time() - LIVE_LAG_S if following else end_s
    w = Window(end - length_s, end, model, scope.instance)
    st.session_state[WINDOW_END] = end
    began = t = time.perf_counter()
    try:
        rows = timeline_rows(engine, w, max_rows=PAGE_MAX_ROWS, requests="marks")
        bars = len(rows.batches) + len(rows.steps)
        marks = int(timeline_chart.marked_requests(rows.requests).sum())
        if following and scope.live and too_many_to_follow(bars, marks):
            st.session_state[FOLLOWING] = False
            st.session_state[END] = _as_end(end)
            st.session_state[STOP_NOTE] = (following_view(scope, model, length_s),
                                           stop_note(bars, marks))
            st.rerun(scope="app")
        selected = _selected(rows)
        charted = rows  # the chart draws the window alone, the picked batch's rows apart
        if selected is not None:
            rows = with_members(engine, rows, selected)
    except WindowTooLarge as exc:
        st.warning(f"{exc}.")
        return
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    view = drawn_view(charted)
    mark = marked(selected, view, st.session_state.get(CLICKED), st.session_state.get(DRAWN))
    fig = timeline_chart.timeline(charted, selected=mark, tz=None)
    st.session_state[DRAWN] = (view, mark)
    build_s = time.perf_counter() - t
    live = ""
    if following and scope.live:
        live = (f" · live: ends {LIVE_LAG_S:.0f} s before now, once the recorder (it writes "
                f"every {RECORDER_FLUSH_S} s) has its rows")
        if every_s is not None and scope.refresh_s is not None and every_s > scope.refresh_s:
            live += (f"; refreshed every {every_s:.0f} s, {COST_FACTOR:.0f}× what a refresh "
                     "of it takes to read and draw (the browser's drawing included)")
    st.caption(f"{fmt_time(w.start_s)} → {fmt_time(w.end_s)} {zone(w.end_s)} · "
               f"{'all models' if model is None else f'model {model}'} · "
               f"{len(rows.batches):,} batches, {rows.requests_in_window:,} requests, "
               f"{len(rows.steps):,} steps · read {1000 * read_s:.0f} ms, drawn "
               f"{1000 * build_s:.0f} ms{live}")
    for note in rows.notes if not rows.empty else ():  # an empty chart says so itself
        st.info(note)
    st.plotly_chart(fig, key="timeline_chart", on_select=_picked_on_chart,
                    selection_mode=("points", "box"), config={"displaylogo": False})
    st.session_state[COST] = ((length_s, model, scope.instance),
                              refresh_cost_s(time.perf_counter() - began, bars, marks))
    _downloads(engine, w, len(rows.batches) + rows.requests_in_window)
    chosen, slow = st.columns([3, 2])
    with slow:
        st.markdown("**Slowest requests in the window**")
        table = timeline_chart.slowest(rows)
        key = _table_key(table, selected)
        st.dataframe(table, key=key, on_select=functools.partial(_picked_in_table, key),
                     selection_mode="single-row", hide_index=True,
                     column_order=list(SLOWEST_COLUMNS), column_config=SLOWEST_COLUMNS)
        st.session_state["timeline_slowest_rows"] = table[["instance_id", "pick"]]
        _show_note("table")
    with chosen:
        if selected is None:
            what = "batch or step" if len(rows.steps) else "batch"
            st.info(f"Pick a {what}: click its bar (or choose the box select tool above the "
                    "chart and drag a box around it; a plain drag zooms), pick one of the "
                    "slowest requests, or type its number in Go to batch number above.")
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
    st.session_state.pop(CLICKED, None)
    if st.session_state.get(FOLLOWING):
        st.session_state[FOLLOWING] = False
        end = st.session_state.get(WINDOW_END, time.time() - LIVE_LAG_S)
        st.session_state[END] = _as_end(end)


def _picked_on_chart() -> None:
    _forget_number()
    points = st.session_state["timeline_chart"].selection.get("points", [])
    for p in points:
        data = p.get("customdata")
        if data is not None and len(data) == 2:
            _pick(data[0], int(data[1]))
            drawn = st.session_state.get(DRAWN)
            st.session_state[CLICKED] = (str(data[0]), int(data[1]),
                                         None if drawn is None else drawn[0])
            return


def _picked_in_table(key: str) -> None:
    _forget_number()
    picked = st.session_state[key].selection.get("rows", [])
    table = st.session_state.get("timeline_slowest_rows")
    if picked and table is not None and picked[0] < len(table):
        inst, seq = table.iloc[picked[0]]
        if pd.isna(seq):
            _say("table", "the batch this request ran in (a generation request's: the step "
                          "it joined) is not in the window")
        else:
            _pick(inst, int(seq))


def _forget_number() -> None:
    """A new pick: the last one's message goes, and a number the page could not go to is
    no longer gone to later (the pick made since is the one shown)."""
    st.session_state.pop(NOTE, None)
    st.session_state.pop(NUMBER_TRIED, None)


def _source(scope: Scope) -> tuple[str, str | None]:
    """The database a scope reads: its URL and the snapshot's name (None: live)."""
    return scope.db_url, scope.snapshot


def _picked_by_number(engine: Engine, scope: Scope, model: str | None,
                      length_s: float) -> None:
    """Go to the batch typed (of ``model``, None: any): the window stops following and
    centres on it. What stops it is kept for the page to say (``NOTE``), and the number
    with what it was looked up in (``NUMBER_TRIED``) for the page to act on once the
    note's advice is taken (:func:`number_again`)."""
    _forget_number()
    text = st.session_state.get(NUMBER, "").strip()
    if not text:  # the box was emptied
        return
    seq = parse_batch_number(text)
    if seq is None:
        _say("number", f"a batch number is a whole number ≥ 0, not {text[:40]!r}")
        return
    found = find_numbered(engine, seq, model, scope.instance)
    if found is None:
        other = None if model is None and scope.instance is None \
            else find_numbered(engine, seq, None, None)
        _say("number", not_found_note(text, other, model, scope.instance))
    else:
        found = {"kind": found["kind"], "key": found["key"],
                 "started_at": float(found["started_at"]), "ended_at": float(found["ended_at"])}
        outside = outside_window_note(found["kind"], text, found["started_at"], scope.start_s,
                                      scope.end_s, scope.live)
        if outside is None:
            _go_to(found, length_s)
            return
        _say("number", outside)
    st.session_state[NUMBER_TRIED] = NumberTried(text, model, scope.instance, _source(scope),
                                                 found)


def _go_to(found: dict, length_s: float) -> None:
    """Show the batch or step ``found`` (:func:`find_numbered`) in a stopped window of
    ``length_s`` centred on it; the number's note and retry go with it."""
    _forget_number()
    ended = float(found["ended_at"])
    time.sleep(behind_edge_in_s(ended, time.time()))  # under a second, for the newest batch
    _pick(*found["key"])
    st.session_state[FOLLOWING] = False
    st.session_state[END] = _as_end(ended + length_s / 2)


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
    else:
        st.markdown(step_header(rows.steps, inst, -seq))
        differs = step_sequences_note(rows.steps, inst, -seq, part)
        if differs is not None:
            st.caption(differs)
    st.plotly_chart(fig, key="timeline_members", config={"displaylogo": False})
    if len(part):
        table = requests_table(part)
        st.dataframe(table, hide_index=True, column_config=ms_columns(table))


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
