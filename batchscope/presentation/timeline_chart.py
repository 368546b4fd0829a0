"""The batch timeline: every batch of a window as a bar in its lane, and the requests of
one batch (or the sequences of one generation step) as queue and compute segments.

Lanes: per model (and instance, when the window has several), batches go in as few
rows as keep them apart (``assign_lanes``; more than one only when batches of a model
overlap, as with several device processes); a generation model's engine steps get a
lane of their own; requests refused or expired in the queue, and bypassed ones, are
marks in a lane under their model.

Drawing: one trace per model and kind, so the cost follows the number of traces, not
of bars: the bars of a lane are one SVG path of thick line segments (``x``: start, end,
gap), and a point at the middle of each carries the hover text and the batch key
(``customdata``: instance, seq) that a click or box selection returns. The points are SVG
while a window has at most ``SVG_POINTS_MAX`` of them and WebGL past that: a browser
keeps about 16 WebGL contexts, a figure with WebGL traces makes its own, and a live page
draws a new figure at every refresh, faster than the browser frees the old ones. A bar
is labelled (``size/max``; a step: its running sequences) only where it is wide enough
for its label on a plot ``PLOT_WIDTH_PX`` wide, so labels never run into each other. x
is seconds after the window's start (floats draw and serialise faster than date-times,
and keep microseconds).

The view: a figure's ``uirevision`` is ``view_key`` (model, instance and length of the
window, not the data), so where the figure is updated in place (``Plotly.react``) a zoom
or pan survives a new figure of the same view (a live refresh, a pick) and a new choice
of window length, model or instance shows the whole window again. (Streamlit 1.67's
``st.plotly_chart`` with selections draws a figure whose content changed afresh, so on
the page a zoom lasts until the chart's next new figure; so a picked batch is marked as
a click marks it, its point selected (drawn large and dark, the others dimmed), and the
page draws the figure as it was after a click.) Legends go below the x axis's
title, out of the way of the toolbar above the plot.
"""

from __future__ import annotations

from datetime import datetime, timezone, tzinfo

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.colors

from batchscope.analysis.queries.timeline import TimelineRows, assign_lanes
from batchscope.presentation import charts

#: the plot's width (pixels) that bar labels are fitted to: about the timeline's plot
#: area on the page; a label is written only on a bar at least as wide as its text
PLOT_WIDTH_PX = 800
LABEL_FONT_PX = 9
#: the width of one label character at ``LABEL_FONT_PX`` (digits and "/" are narrower)
LABEL_CHAR_PX = 6.0
#: a legend row's height (pixels) and the room the x axis's ticks and title take below
#: the plot
LEGEND_ROW_PX = 24
AXIS_BELOW_PX = 52
#: room above the first lane, in lanes, for the event markers (settings changes, the
#: autopilot, OOM), drawn in its middle so that none is cut by the plot's edge
MARKER_ROOM = 0.5
#: hover/select points drawn as SVG while the window holds at most this many (batches,
#: steps and marks); WebGL past it, where SVG would slow the page
SVG_POINTS_MAX = 3000
#: outcomes drawn as marks on a model's "refused / expired" lane
REFUSED = ("rejected", "expired", "cancelled")
FAILED_BATCH = "#d62728"
QUEUE_COLOR = "#c7c7c7"
#: a traced request's bytes arriving and its answer going out (Triton's HTTP/gRPC times)
TRANSPORT_COLOR = "#9edae5"
BAR_WIDTH_PX = 14
#: the point of a picked batch (selected, as a click selects it) is drawn so
PICKED_COLOR = "#111"
PICKED_MARKER_PX = 11
#: the models' colours: plotly's, without its reds (red marks failed batches and
#: refused requests)
PALETTE = [c for c in plotly.colors.qualitative.Plotly if c not in ("#EF553B", "#FF6692")]


def moment(t: float, tz: tzinfo | None = timezone.utc) -> datetime:
    """``t`` (epoch seconds) as an aware time in ``tz`` (None: the machine's local zone, as
    the dashboard shows times)."""
    if tz is not None:
        return datetime.fromtimestamp(t, tz)
    return datetime.fromtimestamp(t).astimezone()


def clock(t: float, tz: tzinfo | None = timezone.utc) -> str:
    """``t`` (epoch seconds) as a time of day to the millisecond in ``tz`` (None: the
    machine's local zone, as the dashboard shows times), followed by the zone's name."""
    at = moment(t, tz)
    return f"{at.strftime('%H:%M:%S.%f')[:-3]} {at.tzname() or 'local time'}"


def model_colors(models) -> dict[str, str]:
    return {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(sorted(set(models)))}


def _segments(starts: np.ndarray, ends: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x and y of line segments (start, end, gap) for ``Scattergl``."""
    n = len(starts)
    gap = np.full(n, np.nan)
    return (np.column_stack([starts, ends, gap]).ravel(),
            np.column_stack([y, y, gap]).ravel())


def _ms(v) -> str:
    return "–" if v is None or pd.isna(v) else f"{1000.0 * float(v):.2f} ms"


def _ms_range(lo, hi) -> str:
    """``lo``–``hi`` in milliseconds, one value where both read the same."""
    a, b = _ms(lo), _ms(hi)
    return a if a == b else f"{a}–{b}"


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 ("1 request", "3 requests")."""
    return f"{n:,} {noun if n == 1 else noun + 's'}"


def view_key(window) -> str:
    """The timeline's ``uirevision``: what the user chose to look at (model, instance and
    the window's length), not the data, so that a zoom survives the refreshes and picks of
    one view and a new choice of window length, model or instance resets it."""
    return (f"timeline|{window.model or '*'}|{window.instance_id or '*'}|"
            f"{window.duration_s:.3f}")


def _batch_hover(b: pd.DataFrame) -> list[str]:
    pad = np.where(b["padded_elements"] > 0, 1.0 - b["real_elements"] / b["padded_elements"]
                   .where(b["padded_elements"] > 0, 1), 0.0)
    bucket = b["bucket"].map(lambda v: "–" if pd.isna(v) else ("overflow" if v == -1 else
                                                                f"≤{int(v)}"))
    grew = b["peak_memory_increase_bytes"] if "peak_memory_increase_bytes" in b else \
        pd.Series([None] * len(b), index=b.index)
    memory = ["" if pd.isna(m) else f" · memory +{float(m) / 2**20:.1f} MiB" for m in grew]
    return [f"<b>batch {int(seq)}</b> · {model}<br>size {int(n)}/{int(mx)} · bucket {bk} · "
            f"padding {100 * p:.0f}%<br>compute {_ms(c)} · wait {_ms_range(wmin, wmax)}<br>"
            f"{pol} · settings v{int(v)} · {out}{' · CUDA graph' if g else ''}{mem}"
            for seq, model, n, mx, bk, p, c, wmin, wmax, pol, v, out, g, mem in zip(
                b["seq"], b["model"], b["batch_size"], b["max_batch_size"], bucket, pad,
                b["compute_s"], b["queue_wait_min_s"], b["queue_wait_max_s"], b["policy"],
                b["settings_version"], b["outcome"], b["cuda_graph"], memory)]


def _step_hover(s: pd.DataFrame) -> list[str]:
    """A step's hover: its number (the one "Go to batch number" takes, and the slowest
    requests' table lists for the step a request joined), its sequences and tokens, its
    time and the KV cache's blocks, used and free."""
    number = s["seq"] if "seq" in s else pd.Series([None] * len(s), index=s.index)
    return [f"<b>{step_name(q)}</b> · {model}<br>{int(r)} running, {int(w)} waiting<br>prefill "
            f"{count(int(p), 'token')} · decode {count(int(d), 'token')}<br>step {_ms(t)} · "
            f"KV blocks {int(u)} used, {int(f)} free · preempted {int(pr)}"
            for q, model, r, w, p, d, t, u, f, pr in zip(
                number, s["model"], s["running"], s["waiting"], s["prefill_tokens"],
                s["decode_tokens"], s["step_s"], s["blocks_used"], s["blocks_free"],
                s["preemptions"])]


def step_name(number) -> str:
    """"step 3320", or "step" for a step recorded without its number."""
    return "step" if number is None or pd.isna(number) else f"step {int(number)}"


class Lanes:
    """The y rows of the chart, top to bottom, and their labels."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def add(self, label: str) -> int:
        self.labels.append(label)
        return len(self.labels) - 1


def timeline(rows: TimelineRows, *, selected: tuple[str, int] | None = None,
             height: int | None = None, tz: tzinfo | None = timezone.utc,
             revision: str | None = None) -> go.Figure:
    """The batch timeline of ``rows`` (see the module doc); ``selected``: the (instance,
    seq) of the batch whose point is drawn selected (``mark_picked``); ``tz``: the zone the x axis names its start in
    (None: local time); ``revision``: the figure's ``uirevision`` (``view_key`` of the
    window by default)."""
    t0 = rows.window.start_s
    span = rows.window.duration_s
    b, r, s = rows.batches, rows.requests, rows.steps
    pairs = pd.concat([df[["instance_id", "model"]].drop_duplicates() for df in (b, r, s)])
    keys = sorted(set(zip(pairs["instance_id"], pairs["model"])), key=lambda k: (k[1], k[0]))
    several = len({inst for inst, _ in keys}) > 1
    colors = model_colors(model for _, model in keys)
    lanes = Lanes()
    traces: list = []
    marks = int(marked_requests(r).sum()) if len(r) else 0
    scatter = go.Scatter if len(b) + len(s) + marks <= SVG_POINTS_MAX else go.Scattergl
    for inst, model in keys:
        name = f"{model} @ {inst[:12]}" if several else model
        color = colors[model]
        mb = b[(b["instance_id"] == inst) & (b["model"] == model)]
        if len(mb):
            sub = assign_lanes(mb["started_at"], mb["ended_at"])
            ys = np.array([lanes.add(f"{name} · batches" + (f" {k + 1}" if k else ""))
                           for k in range(int(sub.max()) + 1)])[sub]
            traces += _bars(mb, ys, t0, name, color, _batch_hover(mb),
                            custom=np.column_stack([mb["instance_id"], mb["seq"]]),
                            labels=_labels(mb, "started_at", "ended_at", span,
                                           _size_label(mb)),
                            failed=(mb["outcome"] != "ok").to_numpy(), scatter=scatter)
        ms = s[(s["instance_id"] == inst) & (s["model"] == model)]
        if len(ms):
            y = lanes.add(f"{name} · steps")
            traces += _bars(ms, np.full(len(ms), y), t0, f"{name} steps", color,
                            _step_hover(ms), custom=np.column_stack(
                                [ms["instance_id"], -ms["id"].astype(np.int64)]),
                            labels=_labels(ms, "started_at", "at", span,
                                           _running_label(ms)),
                            failed=None, start_col="started_at", end_col="at",
                            scatter=scatter)
        mr = r[(r["instance_id"] == inst) & (r["model"] == model)]
        refused = mr[marked_requests(mr)]
        if len(refused):
            y = lanes.add(f"{name} · refused / expired / cancelled / bypass")
            traces += _marks(refused, y, t0, name, scatter)
    n = len(lanes.labels)
    plot_px = max(140, 34 * n)
    fig = charts._base("Batch timeline", height=height or plot_px + 40 + AXIS_BELOW_PX,
                       closest=True, dragmode="zoom", showlegend=True,
                       uirevision=revision or view_key(rows.window))
    if selected is not None:
        mark_picked(traces, selected)
    fig.add_traces(traces)
    fig.update_layout(
        xaxis=dict(title=f"seconds after {clock(t0, tz)}", range=[0, round(span, 6)],
                   zeroline=False),
        yaxis=dict(tickvals=list(range(n)), ticktext=lanes.labels,
                   range=[n - 0.5, -0.5 - MARKER_ROOM], zeroline=False, showgrid=False) if n else
        dict(range=[0.5, -0.5], visible=False))
    if rows.empty:
        charts._empty(fig, "no batch, request or generation step in this window")
        fig.update_xaxes(visible=True)  # the window's own scale, in seconds from its start
    else:
        charts.add_event_markers(fig, rows.events, y=-0.5 - MARKER_ROOM / 2,
                                 x_of=lambda at: np.asarray(at, dtype=float) - t0)
    return _legend_below(fig, fixed_height=height is not None)


def _size_label(batches: pd.DataFrame):
    """The label of the batch at a position of ``batches``: its ``size/max``."""
    sizes, maxima = batches["batch_size"].to_numpy(), batches["max_batch_size"].to_numpy()
    return lambda i: f"{int(sizes[i])}/{int(maxima[i])}"


def _running_label(steps: pd.DataFrame):
    """The label of the step at a position of ``steps``: its running sequences."""
    running = steps["running"].to_numpy()
    return lambda i: str(int(running[i]))


def _labels(df: pd.DataFrame, start_col: str, end_col: str, span_s: float,
            text) -> list[str]:
    """The label of each bar of ``df`` (``text`` of its position), or "" where the bar is
    narrower than its label on a plot ``PLOT_WIDTH_PX`` wide: bars of a lane never
    overlap, and a label centred on a bar at least as wide stays inside it."""
    width_px = (df[end_col].to_numpy(float) - df[start_col].to_numpy(float)) \
        / span_s * PLOT_WIDTH_PX
    out = [""] * len(df)
    for i in np.flatnonzero(width_px >= 3 * LABEL_CHAR_PX):  # the shortest label: "1/1"
        label = text(i)
        if width_px[i] >= len(label) * LABEL_CHAR_PX:
            out[i] = label
    return out


def _legend_below(fig: go.Figure, *, fixed_height: bool = False) -> go.Figure:
    """The legend in rows under the x axis's title, the bottom margin made room for them
    (the figure grows by as much, unless its height is ``fixed_height``): above the plot
    it ran under the toolbar, and just under the plot over the axis's title."""
    names = [t.name for t in fig.data if t.showlegend is not False and t.name]
    rows, used = (1, 0.0) if names else (0, 0.0)
    for name in dict.fromkeys(names):  # the rows a legend of them wraps into
        entry = 40 + 7.0 * len(name)  # the symbol, the gaps and the text at 12 px
        if used and used + entry > PLOT_WIDTH_PX:
            rows, used = rows + 1, 0.0
        used += entry
    bottom = AXIS_BELOW_PX + LEGEND_ROW_PX * rows
    grown = bottom - fig.layout.margin.b
    return fig.update_layout(
        margin=dict(b=bottom), height=fig.layout.height + (0 if fixed_height else grown),
        legend=dict(orientation="h", xref="paper", x=0, xanchor="left", yref="container",
                    y=0, yanchor="bottom"))


def _bars(df: pd.DataFrame, ys: np.ndarray, t0: float, name: str, color: str,
          hover: list[str], *, custom: np.ndarray, labels: list[str],
          failed: np.ndarray | None, start_col: str = "started_at",
          end_col: str = "ended_at", scatter: type = go.Scattergl) -> list:
    """Bars as line segments, and their middles as the points that hover and select
    (``scatter``: SVG or WebGL, see ``SVG_POINTS_MAX``) and carry the bars' ``labels``
    ("": none)."""
    start = df[start_col].to_numpy(float) - t0
    end = df[end_col].to_numpy(float) - t0
    out = []
    groups = [(np.ones(len(df), bool), color, name)] if failed is None or not failed.any() else [
        (~failed, color, name), (failed, FAILED_BATCH, f"{name} (failed / OOM)")]
    for mask, c, label in groups:
        if not mask.any():
            continue
        x, y = _segments(start[mask], end[mask], ys[mask])
        # one SVG path per trace (WebGL lines are drawn off their lane in Streamlit's
        # resizing container)
        out.append(go.Scatter(x=x, y=y, mode="lines", name=label, legendgroup=label,
                              line=dict(color=c, width=BAR_WIDTH_PX), hoverinfo="skip"))
        text = [labels[i] for i in np.flatnonzero(mask)]
        out.append(scatter(
            x=(start[mask] + end[mask]) / 2, y=ys[mask], name=label, legendgroup=label,
            showlegend=False, mode="markers+text" if any(text) else "markers",
            text=text if any(text) else None,
            textposition="top center", textfont=dict(size=LABEL_FONT_PX),
            marker=dict(color=c, size=5, line=dict(width=0)),
            selected=dict(marker=dict(color=PICKED_COLOR, size=PICKED_MARKER_PX)),
            customdata=custom[mask], hovertext=_texts([hover[i] for i in np.flatnonzero(mask)]),
            hoverinfo="text"))
    return out


#: how each kind of mark is drawn on a model's "refused / expired" lane
_MARK_STYLES = {"rejected": ("x", FAILED_BATCH), "expired": ("hourglass", FAILED_BATCH),
                "cancelled": ("circle-open", FAILED_BATCH), "bypass": ("diamond-open", "#555")}


def marked_requests(requests: pd.DataFrame) -> pd.Series:
    """Which of ``requests`` the chart draws as marks: refused, expired, cancelled or
    bypass ones."""
    return requests["outcome"].isin(REFUSED) | requests["bypass"].astype(bool)


def _marks(df: pd.DataFrame, y: int, t0: float, name: str,
           scatter: type = go.Scattergl) -> list:
    """A model's refused, expired, cancelled and bypass requests as marks: one trace per
    kind, each of one symbol and colour (a symbol and a colour per point are checked
    one by one as the figure is built: 20 s for 100,000 marks)."""
    refused = df["outcome"].isin(REFUSED).to_numpy()
    at = np.where(df["bypass"].to_numpy(bool) & ~refused, df["arrived_at"],
                  df["finished_at"]) - t0
    kind = np.where(refused, df["outcome"].to_numpy(object), "bypass")
    out = []
    for k, (symbol, color) in _MARK_STYLES.items():
        mask = kind == k
        if not mask.any():
            continue
        part = df[mask]
        out.append(scatter(
            x=at[mask], y=np.full(int(mask.sum()), y), mode="markers",
            name=f"{name} {k}", legendgroup=f"{name} marks",
            marker=dict(symbol=symbol, size=8, color=color),
            hovertext=_texts([f"{k} · priority {int(p)} · {_mark_times(k, q, lat)}"
                              for p, q, lat in zip(part["priority"], part["queue_wait_s"],
                                                   part["latency_s"])]),
            hoverinfo="text"))
    return out


def _texts(texts: list[str]) -> np.ndarray:
    """Hover texts as a NumPy string array: plotly takes one whole, where it walks a list
    item by item (a second for 100,000 texts)."""
    return np.asarray(texts, dtype=str) if texts else np.asarray([], dtype=str)


def _mark_times(kind: str, queued_s: float, latency_s: float) -> str:
    """What a mark's hover says of its times: a refused or expired request's wait, a
    cancelled one's life and wait (it may have run), a bypass's answer time."""
    if kind == "cancelled":
        return f"cancelled after {_ms(latency_s)} · waited {_ms(queued_s)}"
    if kind == "bypass":
        return f"answered in {_ms(latency_s)}"
    return f"waited {_ms(queued_s)}"


def mark_picked(traces: list, key: tuple[str, int]) -> bool:
    """Select the point of the batch (seq >= 0) or step (seq < 0: ``-id``) that ``key``
    (instance, seq) picks, as a click on it would, among the batch and step points of
    ``traces``: the first point of a repeated number, as ``members`` takes it, on the
    lane its bar is in. The other points are left unselected (dimmed). Whether it was
    found (a batch outside the window is not: nothing is selected)."""
    inst, seq = str(key[0]), int(key[1])
    points = [t for t in traces if t.customdata is not None and t.mode != "lines"]
    for t in points:
        keys = np.asarray(t.customdata, dtype=object)
        hit = np.flatnonzero((keys[:, 0] == inst) & (keys[:, 1].astype(np.int64) == seq))
        if len(hit):
            for other in points:
                other.selectedpoints = [int(hit[0])] if other is t else []
            return True
    return False


def members(rows: TimelineRows, key: tuple[str, int]) -> tuple[go.Figure, pd.DataFrame]:
    """The selected batch's requests (or the sequences running in the selected step):
    one row each, queue wait then compute (for sequences: waiting, prefill until the
    first token, decode), and the table of them."""
    inst, seq = key
    t0 = rows.window.start_s
    r = rows.requests
    if seq >= 0:
        part = rows.members(inst, seq).sort_values("arrived_at")
        title = f"Batch {seq}: {count(len(part), 'request')} — queue wait, then compute"
        phases = [("queue", "arrived_at", "started_at", QUEUE_COLOR),
                  ("compute", "started_at", "finished_at", None)]
        if "trace_id" in part and part["trace_id"].notna().any():  # traced: the transport too
            title += " (traced ones: receive before, send after)"
            phases = [("receive", "recv_start_at", "recv_end_at", TRANSPORT_COLOR), *phases,
                      ("send", "send_start_at", "send_end_at", TRANSPORT_COLOR)]
    else:
        s = rows.steps
        step = s[(s["instance_id"] == inst) & (s["id"] == -seq)]
        if not len(step):
            return charts._empty(charts._base("Members")), r.iloc[:0]
        st0, st1 = float(step["started_at"].iloc[0]), float(step["at"].iloc[0])
        part = r[(r["instance_id"] == inst) & (r["model"] == step["model"].iloc[0])
                 & (r["arrived_at"] <= st1) & (r["finished_at"] >= st0)].sort_values("arrived_at")
        part = part.assign(first_token_at=part["arrived_at"] + part["ttft_s"].fillna(
            part["latency_s"]).astype(float))
        number = step["seq"].iloc[0] if "seq" in step else None
        named = step_name(number).capitalize()
        title = (f"{named} at {st1 - t0:.3f} s: {count(len(part), 'sequence')} — waiting, "
                 "prefill (until the first token), decode")
        phases = [("waiting", "arrived_at", "started_at", QUEUE_COLOR),
                  ("prefill", "started_at", "first_token_at", "#ff7f0e"),
                  ("decode", "first_token_at", "finished_at", None)]
    fig = charts._base(title, height=40 + AXIS_BELOW_PX + max(120, 10 + 18 * len(part)),
                       closest=True, barmode="overlay", uirevision=f"members|{inst}|{seq}")
    if not len(part):
        return _legend_below(charts._empty(fig, "no recorded request in it")), part
    color = model_colors([part["model"].iloc[0]])[part["model"].iloc[0]]
    labels = [f"#{i + 1} p{int(p)}" + (f" len {int(n)}" if not pd.isna(n) else "")
              for i, (p, n) in enumerate(zip(part["priority"], part["length"]))]
    hover = [f"priority {int(p)} · length {'–' if pd.isna(n) else int(n)} · {o}<br>"
             f"waited {_ms(w)} · latency {_ms(lat)}" + ("" if pd.isna(tt) else
                                                       f" · first token {_ms(tt)}")
             for p, n, o, w, lat, tt in zip(part["priority"], part["length"], part["outcome"],
                                            part["queue_wait_s"], part["latency_s"],
                                            part["ttft_s"])]
    times = [pd.to_numeric(part[col], errors="coerce").to_numpy(float)
             for _, a, z, _ in phases for col in (a, z)]
    axis = MemberAxis.of(np.concatenate(times), t0)
    for phase, a, z, c in phases:
        start = axis.x(pd.to_numeric(part[a], errors="coerce").to_numpy(float))
        end = axis.x(pd.to_numeric(part[z], errors="coerce").to_numpy(float))
        fig.add_trace(go.Bar(y=labels, x=np.maximum(end - start, 0),
                             base=start, orientation="h", name=phase, hovertext=hover,
                             hoverinfo="text+name", marker=dict(color=c or color)))
    if seq < 0:  # the step itself: a band across the sequences alive during it
        fig.add_vrect(x0=axis.x(st0), x1=axis.x(st1), fillcolor=PICKED_COLOR, opacity=0.15,
                      line=dict(color=PICKED_COLOR, width=1, dash="dot"), layer="above",
                      annotation=dict(text=named.lower(), font=dict(size=LABEL_FONT_PX)),
                      annotation_position="top")
    fig.update_layout(xaxis=dict(title=axis.title),
                      yaxis=dict(autorange="reversed", type="category"))
    return _legend_below(fig), part


#: a member chart spanning less than this is drawn in milliseconds
MEMBER_MS_SPAN_S = 10.0


class MemberAxis:
    """The member chart's x axis: time from the first member's arrival, in milliseconds
    while the members span less than ``MEMBER_MS_SPAN_S`` (a batch of a millisecond read
    in seconds after the window's start has ticks like 4.9965 ... 5), else in seconds."""

    def __init__(self, origin: float, scale: float, unit: str, t0: float) -> None:
        self.origin, self.scale, self.unit, self.t0 = origin, scale, unit, t0

    @classmethod
    def of(cls, times: np.ndarray, t0: float) -> "MemberAxis":
        known = times[np.isfinite(times)]
        if not len(known):
            return cls(t0, 1.0, "s", t0)
        origin, span = float(known.min()), float(known.max() - known.min())
        return cls(origin, *((1000.0, "ms") if span < MEMBER_MS_SPAN_S else (1.0, "s")), t0)

    def x(self, t):
        return (np.asarray(t, dtype=float) - self.origin) * self.scale

    @property
    def title(self) -> str:
        return (f"{self.unit} after the first arrival ({self.origin - self.t0:.3f} s after "
                "the window's start)")


def slowest(rows: TimelineRows, n: int = 20) -> pd.DataFrame:
    """The ``n`` slowest requests of the window, with the batch each was answered in."""
    r = rows.requests
    if not len(r):
        return pd.DataFrame(columns=["finished", "model", "latency_ms", "queue_ms",
                                     "compute_ms", "batch", "priority", "length", "outcome",
                                     "instance_id", "pick"])
    top = r.nlargest(n, "latency_s")
    size, pick = _joined(rows, top)
    return pd.DataFrame({
        "finished": top["finished_at"].to_numpy() - rows.window.start_s,
        "model": top["model"].to_numpy(),
        "latency_ms": 1000 * top["latency_s"].to_numpy(float),
        "queue_ms": 1000 * top["queue_wait_s"].to_numpy(float),
        "compute_ms": 1000 * (top["latency_s"] - top["queue_wait_s"]).to_numpy(float),
        # nullable integers: a batch not in the window shows an empty cell, not "None"
        "batch": pd.array(top["batch_seq"].to_numpy(), dtype="Int64"),
        "batch_size": pd.array(size, dtype="Int64"),
        "priority": top["priority"].to_numpy(), "length": top["length"].to_numpy(),
        "outcome": top["outcome"].to_numpy(), "instance_id": top["instance_id"].to_numpy(),
        "pick": pick})


def _joined(rows: TimelineRows, top: pd.DataFrame) -> tuple[list, list]:
    """For each request of ``top``: the size of the batch it joined (a generation
    request's: the sequences running in the step it was first scheduled in) and the key
    that selects it on the chart (a batch's seq; a step's ``-id``), None where that batch
    or step is not in the window. A generation request (it has prompt tokens) is never
    matched to a request model's batch: their numbers are counted apart."""
    b, st = rows.batches, rows.steps
    batches: dict = {}  # the first of a repeated number, as the trace export takes it
    for i, m, q, n in zip(b["instance_id"], b["model"], b["seq"], b["batch_size"]):
        if not pd.isna(q):
            batches.setdefault((i, m, int(q)), int(n))
    steps: dict = {}
    if "seq" in st:
        for i, m, q, n, k in zip(st["instance_id"], st["model"], st["seq"], st["running"],
                                 st["id"]):
            if not pd.isna(q):
                steps.setdefault((i, m, int(q)), (int(n), -int(k)))
    generation = top["prompt_tokens"].notna() if "prompt_tokens" in top \
        else pd.Series(False, index=top.index)
    size, pick = [], []
    for i, m, q, gen in zip(top["instance_id"], top["model"], top["batch_seq"], generation):
        if pd.isna(q):
            size.append(None), pick.append(None)
        elif gen:
            n, key = steps.get((i, m, int(q)), (None, None))
            size.append(n), pick.append(key)
        else:
            n = batches.get((i, m, int(q)))
            size.append(n), pick.append(None if n is None else int(q))
    return size, pick
