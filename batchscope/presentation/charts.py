"""Plotly figure builders: ``DataFrame -> plotly Figure``.

The only module that imports plotly. Every time chart carries the window's
settings changes and OOM / error events as markers whose hover text says what
changed. ``build_all`` makes every chart of a query bundle (``queries.live_bundle``);
the dashboard and the offline report both use it, keyed by ``CHARTS``.

Speed: a live refresh builds a dozen figures every few seconds. What costs is not the
data (a window is about 60 points a series) but plotly's checking of the layout: the
template alone (``plotly_white``, some 200 nested properties) took 15-45 ms a figure to
validate, and each ``add_vline`` 7 ms. So the template and the subplot grids are made
once (``_template``, ``_grid``) and handed to every figure without being checked again,
and reference lines are written as the shape and annotation dicts ``add_vline`` /
``add_hline`` would make (``_vline``, ``_hline``). Traces are still ``go`` objects,
checked as they are built. ``tests/test_dash_charts.py`` checks that every figure passes
plotly's full validation.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

GIB = 1024 ** 3
SETTINGS_MARKER = "settings changes"
FAULT_MARKER = "OOM / errors"
FAULT_KINDS = ("oom", "oom_failed", "model_error")
AUTOPILOT_MARKER = "autopilot decisions"
COMPILE_MARKER = "compilation"
COMPILE_KINDS = ("compile", "compile_failed")
SPECULATION_MARKER = "speculation switched"
ADAPTER_LOAD_MARKER = "adapter loaded"
ADAPTER_EVICT_MARKER = "adapter evicted"
GENERATION_PANELS = ("sequences", "tokens per step", "KV cache blocks used", "preemptions")
#: the generation chart's third row, drawn when a step in the window had a proposer
SPECULATION_PANELS = ("speculation: acceptance rate", "speculation: tokens per verification")

#: chart key -> title (keys are what diagnosis flags point at)
CHARTS: dict[str, str] = {
    "latency": "Latency percentiles",
    "throughput": "Throughput",
    "wait_compute": "Queue wait vs compute",
    "queue_depth": "Queue depth",
    "batch_sizes": "Batch sizes",
    "batch_efficiency": "Items per compute second by batch size",
    "device": "Device utilization and memory",
    "padding": "Padding waste per bucket",
    "priority": "Latency per priority",
    "model_share": "Device share per model",
    "generation": "Generation: sequences, tokens, cache, preemptions",
    "generation_latency": "Generation: time to first token and per-token latency",
}


def _times(seconds) -> pd.Series:
    return pd.to_datetime(pd.Series(seconds, dtype="float64"), unit="s").dt.floor("us")


TEMPLATE = "plotly_white"


@functools.cache
def _template() -> dict:
    """The figures' template as plain data, made once (a figure copies what it is given)."""
    return pio.templates[TEMPLATE].to_plotly_json()


@functools.cache
def _grid_json(kind: str) -> dict:
    """The layout ``make_subplots`` gives a grid, without its template: ``secondary_y``
    (one plot, a second y axis on the right), ``generation`` (two by two, titled) or
    ``speculation`` (the generation grid with a third row for speculation)."""
    from plotly.subplots import make_subplots

    if kind == "secondary_y":
        fig = make_subplots(specs=[[{"secondary_y": True}]])
    elif kind == "speculation":
        fig = make_subplots(rows=3, cols=2, shared_xaxes=True, vertical_spacing=0.09,
                            subplot_titles=GENERATION_PANELS + SPECULATION_PANELS)
    else:
        fig = make_subplots(rows=2, cols=2, shared_xaxes=True, vertical_spacing=0.12,
                            subplot_titles=GENERATION_PANELS)
    layout = fig.layout.to_plotly_json()
    layout.pop("template", None)
    return layout


def _layout(title: str, height: int = 320) -> dict:
    return dict(title=dict(text=title, x=0.01, font=dict(size=14)), height=height,
                template=_template(), margin=dict(l=50, r=20, t=40, b=40),
                legend=dict(orientation="h", y=-0.27), hovermode="x unified")


def _base(title: str, *, height: int = 320, closest: bool = False, grid: str | None = None,
          **layout) -> go.Figure:
    """An empty figure in the dashboard's style (``grid``: a ``_grid_json`` kind);
    ``layout``: more layout properties (axes, bar mode). Built without checking the
    layout again (see the module's docstring)."""
    spec = {**(_grid_json(grid) if grid else {}), **_layout(title, height), **layout}
    if closest:  # categorical charts: hover the bar/point under the cursor
        spec["hovermode"] = "closest"
    return go.Figure(layout=spec, _validate=False)


def _empty(fig: go.Figure, what: str = "no data in this window") -> go.Figure:
    """``fig`` saying ``what``, with no axes: an empty figure's would be plotly's
    placeholder scale (-1 to 4, 0 to 6), which reads as data."""
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _annotate(fig, [dict(text=what, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                                font=dict(color="#888"))])


def _annotate(fig: go.Figure, annotations: list[dict] = (), shapes: list[dict] = ()) -> go.Figure:
    """Append ``annotations`` and ``shapes`` to the figure's own, in one layout update."""
    update = {}
    if annotations:
        update["annotations"] = [*fig.layout.annotations, *annotations]
    if shapes:
        update["shapes"] = [*fig.layout.shapes, *shapes]
    if update:
        fig.update_layout(update)
    return fig


def _vline(x, line: dict, label: str | None = None,
           axes: tuple[str, str] = ("x", "y")) -> list[dict]:
    """A vertical line across the plot at ``x`` (and its label above it), as
    ``fig.add_vline(x, line=..., annotation_text=label, annotation_position="top")``
    (``axes``: the x and y axes of the plot in a grid)."""
    out = [dict(type="line", x0=x, x1=x, xref=axes[0], y0=0, y1=1, yref=f"{axes[1]} domain",
                line=line)]
    if label is not None:
        out.append(dict(showarrow=False, text=label, x=x, xanchor="center", xref="x", y=1,
                        yanchor="bottom", yref="y domain"))
    return out


def _hline(y: float, line: dict, label: str | None = None) -> list[dict]:
    """A horizontal line across the plot at ``y`` (and its label at its top left), as
    ``fig.add_hline(y, line=..., annotation_text=label, annotation_position="top left")``."""
    out = [dict(type="line", x0=0, x1=1, xref="x domain", y0=y, y1=y, yref="y", line=line)]
    if label is not None:
        out.append(dict(showarrow=False, text=label, x=0, xanchor="left", xref="x domain", y=y,
                        yanchor="bottom", yref="y"))
    return out


def _lines(fig: go.Figure, items: list[list[dict]]) -> go.Figure:
    """Add ``_vline``/``_hline`` results: shapes and annotations apart."""
    flat = [d for item in items for d in item]
    return _annotate(fig, [d for d in flat if "type" not in d], [d for d in flat if "type" in d])


def _describe_change(message: str, details_json: str) -> str:
    try:
        details = json.loads(details_json or "{}")
    except ValueError:
        return message
    old, new = details.get("old") or {}, details.get("new") or {}
    if not isinstance(new, dict) or not new:
        return message
    who = details.get("requested_by")
    text = "<br>".join(f"{k}: {old.get(k) if isinstance(old, dict) else '?'} → {v}"
                       for k, v in new.items() if not isinstance(old, dict) or old.get(k) != v)
    return f"{text or message}" + (f"<br>by {who}" if who else "")


def add_event_markers(fig: go.Figure, events: pd.DataFrame | None, *, y: float | None = None,
                      axes: tuple[str, str] | None = None, x_of=_times,
                      legend: bool = True) -> go.Figure:
    """Mark settings changes, the autopilot's reasons, OOM / error events, torch.compile
    runs, the speculation switch's decisions and LoRA adapter loads and evictions on a
    time chart (``axes``: the x and y
    axes of the markers in a grid, e.g. ``("x", "y")``; ``x_of``: the chart's x of
    wall-clock seconds, date-times by default; ``legend`` False: the same markers on
    another panel, shown and hidden with the first ones' legend entry)."""
    if events is None or not len(events):
        return fig
    if y is None:
        ys = [np.asarray(tr.y, dtype="float64") for tr in fig.data if tr.y is not None]
        ys = np.concatenate(ys) if ys else np.empty(0)
        y = float(np.nanmax(ys)) if (~np.isnan(ys)).any() else 1.0
    where = {} if axes is None else {"xaxis": axes[0], "yaxis": axes[1]}
    shapes: list[dict] = []
    for name, kinds, symbol, color in (
            (SETTINGS_MARKER, ("settings_change",), "diamond", "#6a3d9a"),
            (AUTOPILOT_MARKER, ("autopilot",), "triangle-up", "#2ca02c"),
            (FAULT_MARKER, FAULT_KINDS, "x", "#d62728"),
            (COMPILE_MARKER, COMPILE_KINDS, "star", "#8c564b"),
            (SPECULATION_MARKER, ("speculation",), "triangle-down", "#17becf"),
            (ADAPTER_LOAD_MARKER, ("adapter_load",), "circle-open", "#bcbd22"),
            (ADAPTER_EVICT_MARKER, ("adapter_evict",), "square-open", "#7f7f7f")):
        sel = events[events["kind"].isin(kinds)]
        if not len(sel):
            continue
        hover = [(_describe_change(m, d) if k == "settings_change" else m)
                 for m, d, k in zip(sel["message"], sel["details_json"], sel["kind"])]
        x = x_of(sel["at"])
        fig.add_trace(go.Scatter(x=x, y=[y] * len(sel), mode="markers", name=name,
                                 marker=dict(symbol=symbol, size=11, color=color),
                                 hovertext=hover, hoverinfo="text+x", legendgroup=name,
                                 showlegend=legend, **where))
        line = dict(color=color, width=1, dash="dot")
        shapes += [shape for t in x for shape in _vline(t, line, axes=axes or ("x", "y"))]
    return _annotate(fig, shapes=shapes)


def _axis(title: str, **more) -> dict:
    return dict(title=dict(text=title), **more)


#: room above the tallest bar, as a fraction of it
BAR_HEADROOM = 0.12


def _bar_axis(title: str, values, **more) -> dict:
    """A value axis from 0 to a little above the largest finite value: plotly's own
    range leaves a bar's top at the plot's edge, above the last tick, where it reads as
    cut off, and an infinite value (a percentile past the histograms' last bucket) has
    no top at all."""
    finite = np.asarray(values, dtype="float64")
    finite = finite[np.isfinite(finite)]
    top = float(finite.max()) if len(finite) else 0.0
    if top <= 0:
        return _axis(title, rangemode="tozero", **more)
    return _axis(title, range=[0.0, top * (1.0 + BAR_HEADROOM)], **more)


def _finite(values) -> np.ndarray:
    """``values`` with infinities as NaN (no bar): a bar to infinity has no top to draw."""
    out = np.asarray(values, dtype="float64").copy()
    out[~np.isfinite(out)] = np.nan
    return out


#: the least time a time chart's x axis spans: a window that has only begun (a runtime
#: started a second ago) is drawn over this much, its points marked, instead of an axis of
#: a millisecond ticked in tenths of one with lines too short to see
MIN_SPAN_S = 30.0


def _readable_time(fig: go.Figure) -> go.Figure:
    """``fig`` (a time chart) readable however little data it has: while its points and
    markers span less than ``MIN_SPAN_S``, each x axis spans that much, ending a little
    after the last of them, and a line of a single point is marked."""
    xs = [pd.to_datetime(np.asarray(tr.x)) for tr in fig.data
          if tr.x is not None and len(tr.x)]
    if not xs:
        return fig
    first, last = min(x.min() for x in xs), max(x.max() for x in xs)
    if pd.isna(first) or (last - first).total_seconds() >= MIN_SPAN_S:
        return fig
    end = last + pd.Timedelta(seconds=MIN_SPAN_S / 10)
    fig.update_xaxes(range=[end - pd.Timedelta(seconds=MIN_SPAN_S), end])
    fig.update_traces(selector=lambda tr: (tr.type == "scatter" and tr.mode == "lines"
                                           and tr.x is not None and len(tr.x) == 1),
                      mode="lines+markers")
    return fig


def latency(requests_t: pd.DataFrame, events: pd.DataFrame | None = None,
            slo_ms: float | None = None) -> go.Figure:
    if not len(requests_t) or requests_t["latency_p50"].isna().all():
        return _empty(_base(CHARTS["latency"]))
    fig = _base(CHARTS["latency"], yaxis=_axis("ms", rangemode="tozero"))
    x = _times(requests_t["t"])
    for p, color in ((50, "#1f77b4"), (95, "#ff7f0e"), (99, "#d62728")):
        fig.add_trace(go.Scatter(x=x, y=requests_t[f"latency_p{p}"] * 1000, name=f"p{p}",
                                 mode="lines", line=dict(color=color)))
    if slo_ms:
        fig.add_trace(go.Scatter(x=[x.iloc[0], x.iloc[-1]], y=[slo_ms, slo_ms], name="SLO",
                                 mode="lines", line=dict(color="#444", dash="dash")))
    return _readable_time(add_event_markers(fig, events))


def throughput(requests_t: pd.DataFrame, batches_t: pd.DataFrame,
               events: pd.DataFrame | None = None) -> go.Figure:
    if not len(requests_t) and not len(batches_t):
        return _empty(_base(CHARTS["throughput"]))
    fig = _base(CHARTS["throughput"], yaxis=_axis("per second", rangemode="tozero"))
    if len(requests_t):
        x = _times(requests_t["t"])
        fig.add_trace(go.Scatter(x=x, y=requests_t["ok_per_s"], name="served req/s", mode="lines"))
        fig.add_trace(go.Scatter(x=x, y=requests_t["failed_per_s"], name="rejected+expired+errors /s",
                                 mode="lines", line=dict(color="#d62728")))
    if len(batches_t):
        fig.add_trace(go.Scatter(x=_times(batches_t["t"]), y=batches_t["batches_per_s"],
                                 name="batches/s", mode="lines", line=dict(dash="dot")))
    return _readable_time(add_event_markers(fig, events))


def wait_vs_compute(batches_t: pd.DataFrame, events: pd.DataFrame | None = None) -> go.Figure:
    if not len(batches_t):
        return _empty(_base(CHARTS["wait_compute"]))
    fig = _base(CHARTS["wait_compute"], yaxis=_axis("ms per batch (mean)", rangemode="tozero"))
    x = _times(batches_t["t"])
    fig.add_trace(go.Scatter(x=x, y=batches_t["queue_wait_mean_s"] * 1000, name="queue wait",
                             stackgroup="one", mode="lines"))
    fig.add_trace(go.Scatter(x=x, y=batches_t["compute_mean_s"] * 1000, name="compute",
                             stackgroup="one", mode="lines"))
    return _readable_time(add_event_markers(fig, events))


def queue_depth(batches_t: pd.DataFrame, events: pd.DataFrame | None = None) -> go.Figure:
    if not len(batches_t) or batches_t["queue_depth_max"].isna().all():
        return _empty(_base(CHARTS["queue_depth"]))
    fig = _base(CHARTS["queue_depth"], yaxis=_axis("waiting requests", rangemode="tozero"))
    x = _times(batches_t["t"])
    fig.add_trace(go.Scatter(x=x, y=batches_t["queue_depth_mean"], name="mean", mode="lines"))
    fig.add_trace(go.Scatter(x=x, y=batches_t["queue_depth_max"], name="max", mode="lines",
                             line=dict(dash="dot")))
    return _readable_time(add_event_markers(fig, events))


def batch_sizes(sizes: pd.DataFrame, max_batch_size: float | None = None) -> go.Figure:
    fig = _base(CHARTS["batch_sizes"], closest=True)
    if not len(sizes):
        return _empty(fig)
    fig.update_layout(xaxis=_axis("batch size"), yaxis=_axis("batches"))
    fig.add_trace(go.Bar(x=sizes["batch_size"], y=sizes["batches"], name="batches"))
    if max_batch_size and pd.notna(max_batch_size):
        _lines(fig, [_vline(float(max_batch_size), dict(color="#d62728", dash="dash"),
                            f"max {int(max_batch_size)}")])
    return fig


def batch_efficiency(sizes: pd.DataFrame) -> go.Figure:
    fig = _base(CHARTS["batch_efficiency"], closest=True)
    if not len(sizes):
        return _empty(fig)
    fig.update_layout(xaxis=_axis("batch size"),
                      yaxis=_axis("items per compute second", rangemode="tozero"))
    fig.add_trace(go.Scatter(x=sizes["batch_size"], y=sizes["items_per_compute_s"],
                             mode="lines+markers", name="items / compute s",
                             marker=dict(size=(sizes["batches"].clip(upper=400) ** 0.5 + 3))))
    return fig


def device(device_t: pd.DataFrame, events: pd.DataFrame | None = None) -> go.Figure:
    fig = _base(CHARTS["device"], grid="secondary_y")
    if not len(device_t):
        return _empty(fig)
    fig.update_layout(yaxis=_axis("utilization %", range=[0, 105]),
                      yaxis2=_axis("GiB", rangemode="tozero"))
    for dev, part in device_t.groupby("device"):
        x = _times(part["t"])
        fig.add_trace(go.Scatter(x=x, y=part["utilization_pct"], name=f"{dev} utilization %",
                                 mode="lines", xaxis="x", yaxis="y"))
        mem = part["memory_used_bytes"]
        if mem.isna().all():
            mem = part["process_rss_bytes"]
        fig.add_trace(go.Scatter(x=x, y=mem / GIB, name=f"{dev} memory GiB", mode="lines",
                                 line=dict(dash="dot"), xaxis="x", yaxis="y2"))
        total = part["memory_total_bytes"].dropna()
        if len(total):
            fig.add_trace(go.Scatter(x=[x.iloc[0], x.iloc[-1]], y=[total.max() / GIB] * 2,
                                     name=f"{dev} memory limit", mode="lines",
                                     line=dict(color="#999", dash="dash"), xaxis="x", yaxis="y2"))
    return _readable_time(add_event_markers(fig, events, y=100.0))


def padding(pad: pd.DataFrame) -> go.Figure:
    fig = _base(CHARTS["padding"], closest=True)
    if not len(pad):
        return _empty(fig, "no variable-length batches in this window")
    # a short axis title: a long one runs into the chart's title; the hover explains it
    fig.update_layout(yaxis=_axis("padding %", range=[0, 100]),
                      xaxis=_axis("length bucket", type="category"))
    labels = [("overflow" if b == -1 else f"≤{int(b)}") for b in pad["bucket"]]
    fig.add_trace(go.Bar(x=labels, y=pad["waste_fraction"] * 100, name="padding %",
                         customdata=pad[["batches", "real_elements", "padded_elements"]],
                         hovertemplate="bucket %{x}<br>%{y:.1f}% of computed elements are "
                                       "padding<br>batches %{customdata[0]}<br>real "
                                       "%{customdata[1]} / padded %{customdata[2]}"
                                       "<extra></extra>"))
    return fig


def priority(stats: pd.DataFrame) -> go.Figure:
    fig = _base(CHARTS["priority"], closest=True, barmode="group")
    if not len(stats):
        return _empty(fig)
    values = {p: _finite(stats[f"latency_p{p}"].astype("float64") * 1000) for p in (50, 95, 99)}
    fig.update_layout(yaxis=_bar_axis("latency ms", np.concatenate(list(values.values()))))
    # recorded priorities are the engine's (0 = most urgent); HTTP clients send p + 1
    labels = [f"priority {int(p)} (HTTP {int(p) + 1})" for p in stats["priority"]]
    for p, y in values.items():
        fig.add_trace(go.Bar(x=labels, y=y, name=f"p{p}"))
    return fig


def model_share(share: pd.DataFrame) -> go.Figure:
    fig = _base(CHARTS["model_share"], closest=True)
    if not len(share):
        return _empty(fig)
    fig.add_trace(go.Pie(labels=share["model"], values=share["compute_total_s"], hole=0.45,
                         name="compute s", textinfo="label+percent"))
    return fig


def speculating(gen_t: pd.DataFrame) -> bool:
    """Whether a step of the window had a proposer (speculative decoding set up)."""
    return "spec_steps" in gen_t and bool((gen_t["spec_steps"].fillna(0) > 0).any())


def generation(gen_t: pd.DataFrame, events: pd.DataFrame | None = None) -> go.Figure:
    """Sequences, tokens per step (decode, the proposed tokens verified with it, and
    prefill on top, stacked), KV-cache blocks and preemptions; with speculative
    decoding a third row: the acceptance rate with the share of steps that speculated,
    and the tokens a sequence gains per verification, with the speculation switch's
    decisions marked."""
    spec = speculating(gen_t)
    title = CHARTS["generation"] + (", speculation" if spec else "")
    fig = _base(title, height=680 if spec else 480, grid="speculation" if spec else "generation")
    if not len(gen_t):
        return _empty(fig)
    x = _times(gen_t["t"])

    def stacked(column: str, name: str) -> go.Scatter:
        return go.Scatter(x=x, y=gen_t[column], name=name, mode="lines", stackgroup="tokens",
                          xaxis="x2", yaxis="y2")

    # the panels' axes, left to right and top to bottom: x/y, x2/y2, x3/y3, x4/y4 (x5/y5, x6/y6)
    fig.add_traces([
        go.Scatter(x=x, y=gen_t["running"], name="running", mode="lines", xaxis="x", yaxis="y"),
        go.Scatter(x=x, y=gen_t["waiting"], name="waiting", mode="lines", xaxis="x", yaxis="y"),
        stacked("decode_per_step", "decode tokens/step"),
        *([stacked("proposed_per_step", "proposed tokens/step")] if spec else []),
        stacked("prefill_per_step", "prefill tokens/step"),
        go.Scatter(x=x, y=gen_t["blocks_used"], name="blocks used", mode="lines", xaxis="x3",
                   yaxis="y3"),
        go.Scatter(x=x, y=gen_t["blocks_total"], name="blocks total", mode="lines",
                   line=dict(dash="dash", color="#999"), xaxis="x3", yaxis="y3"),
        go.Bar(x=x, y=gen_t["preemptions"], name="preemptions", xaxis="x4", yaxis="y4")])
    add_event_markers(fig, events, y=float(gen_t["running"].max()), axes=("x", "y"))
    if spec:
        _speculation_row(fig, gen_t, x, events)
    return _readable_time(fig)


def _speculation_row(fig: go.Figure, gen_t: pd.DataFrame, x: pd.Series,
                     events: pd.DataFrame | None) -> None:
    """The generation chart's speculation panels, the switch's decisions marked on them
    and on the tokens per step."""
    fig.add_traces([
        go.Scatter(x=x, y=gen_t["acceptance_rate"] * 100, name="acceptance rate %",
                   mode="lines+markers", marker=dict(size=4), xaxis="x5", yaxis="y5"),
        go.Scatter(x=x, y=gen_t["speculating_fraction"] * 100, name="steps speculating %",
                   mode="lines", line=dict(dash="dot", color="#7f7f7f"), xaxis="x5", yaxis="y5"),
        go.Scatter(x=x, y=gen_t["acceptance_length"], name="tokens per verification",
                   mode="lines+markers", marker=dict(size=4), xaxis="x6", yaxis="y6")])
    fig.update_layout({"yaxis5.range": [0, 105], "yaxis5.ticksuffix": "%",
                       "yaxis6.rangemode": "tozero"})
    if events is None or not len(events):
        return
    switches = events[events["kind"] == "speculation"]
    length = gen_t["acceptance_length"].max()
    tokens = gen_t[["prefill_per_step", "decode_per_step", "proposed_per_step"]].sum(axis=1).max()
    for axes, y in ((("x2", "y2"), tokens), (("x5", "y5"), 100.0),
                    (("x6", "y6"), length if pd.notna(length) else 1.0)):
        add_event_markers(fig, switches, y=float(y), axes=axes, legend=False)


def generation_latency(summary: pd.DataFrame) -> go.Figure:
    fig = _base(CHARTS["generation_latency"], closest=True, barmode="group")
    if not len(summary) or pd.isna(summary.iloc[0].get("ttft_p50")):
        return _empty(fig, "no finished generation requests in this window")
    fig.update_layout(yaxis=_axis("ms"))
    row = summary.iloc[0]
    for p in (50, 95, 99):
        fig.add_trace(go.Bar(x=["time to first token", "time per output token"],
                             y=[row[f"ttft_p{p}"] * 1000, row[f"tpot_p{p}"] * 1000], name=f"p{p}"))
    return fig


def compare(before: pd.DataFrame, after: pd.DataFrame, *, labels=("before", "after")) -> go.Figure:
    """Key headline figures of two windows side by side (each normalised to 'before')."""
    fig = _base("Before / after", closest=True, barmode="group")
    keys = [("ok_per_s", "served req/s"), ("mean_batch_size", "mean batch size"),
            ("latency_p50", "p50 latency"), ("latency_p99", "p99 latency"),
            ("queue_wait_mean_s", "mean queue wait")]
    times = {"latency_p50", "latency_p99", "queue_wait_mean_s"}  # seconds, shown in ms
    if not len(before) or not len(after):
        return _empty(fig)
    for label, frame in zip(labels, (before, after)):
        row = frame.iloc[0]
        vals = [row.get(k) for k, _ in keys]
        texts = [("—" if v is None or pd.isna(v) else
                  (f"{v * 1000:.1f} ms" if k in times else f"{v:.1f}"))
                 for v, (k, _) in zip(vals, keys)]
        base = [before.iloc[0].get(k) for k, _ in keys]
        rel = [(v / b if v is not None and b and pd.notna(v) and pd.notna(b) else None)
               for v, b in zip(vals, base)]
        fig.add_trace(go.Bar(x=[n for _, n in keys], y=rel, name=label, text=texts,
                             textposition="outside"))
    fig.update_yaxes(title_text="relative to before")
    return fig


def build_all(bundle: dict[str, pd.DataFrame], *, slo_ms: float | None = None) -> dict[str, go.Figure]:
    """Every chart of a ``queries.live_bundle`` result, keyed like ``CHARTS``."""
    ev = bundle.get("events")
    head = bundle["headline"].iloc[0] if len(bundle["headline"]) else {}
    figs = {
        "latency": latency(bundle["requests_t"], ev, slo_ms),
        "throughput": throughput(bundle["requests_t"], bundle["batches_t"], ev),
        "wait_compute": wait_vs_compute(bundle["batches_t"], ev),
        "queue_depth": queue_depth(bundle["batches_t"], ev),
        "batch_sizes": batch_sizes(bundle["batch_sizes"], head.get("max_batch_size")),
        "batch_efficiency": batch_efficiency(bundle["batch_sizes"]),
        "device": device(bundle["device_t"], ev),
        "padding": padding(bundle["padding"]),
        "priority": priority(bundle["priority"]),
        "model_share": model_share(bundle["model_share"]),
    }
    if "generation_t" in bundle:
        figs["generation"] = generation(bundle["generation_t"], ev)
        figs["generation_latency"] = generation_latency(bundle["generation"])
    return figs


# -- tuning sessions ---------------------------------------------------------------------------
TUNING_TITLE = "Tuning trials: throughput vs p99"


def pareto_front(points: pd.DataFrame, x: str = "p99_ms", y: str = "throughput_rps") -> pd.DataFrame:
    """The rows no other row beats on both counts (lower ``x`` and higher ``y``), by ``x``."""
    known = points.dropna(subset=[x, y]).sort_values([x, y], ascending=[True, False])
    best_y = float("-inf")
    keep = []
    for index, value in known[y].items():
        if value > best_y:
            keep.append(index)
            best_y = value
    return known.loc[keep]


def tuning_trials(trials: pd.DataFrame, *, slo_ms: float | None = None,
                  current: int | None = 0, recommended: int | None = None) -> go.Figure:
    """Each trial of a tuning session as a point (x: p99, y: throughput; hover: goodput
    and the settings it changed), feasible and infeasible apart, the Pareto front as a
    line, the SLO as a vertical line, the current (``current``: a trial number) and the
    recommended settings marked. ``trials``: rows of ``Trial.row``."""
    fig = _base(TUNING_TITLE, height=380, closest=True)
    if not len(trials) or trials["p99_ms"].isna().all():
        return _empty(fig, "no trial measured yet")
    shown = trials.dropna(subset=["p99_ms", "throughput_rps"])
    hover = ("trial %{customdata[0]}<br>%{customdata[1]}<br>p99 %{x:.1f} ms<br>"
             "throughput %{y:.1f} req/s<br>goodput %{customdata[2]:.1f} req/s<br>%{customdata[3]}"
             "<extra></extra>")

    def points(rows: pd.DataFrame, name: str, color: str, symbol: str = "circle",
               size: int = 9) -> None:
        if not len(rows):
            return
        custom = rows[["trial", "changed", "goodput_rps"]].assign(
            note=rows["problem"].fillna(rows["status"]))
        fig.add_trace(go.Scatter(x=rows["p99_ms"], y=rows["throughput_rps"], mode="markers",
                                 name=name, customdata=custom.to_numpy(), hovertemplate=hover,
                                 marker=dict(color=color, symbol=symbol, size=size,
                                             line=dict(width=1, color="#333"))))

    feasible = shown["feasible"].astype(bool)
    points(shown[feasible], "feasible", "#1f77b4")
    points(shown[~feasible], "infeasible / unsettled", "#bbbbbb")
    front = pareto_front(shown)
    if len(front) > 1:
        fig.add_trace(go.Scatter(x=front["p99_ms"], y=front["throughput_rps"], mode="lines",
                                 name="Pareto front", line=dict(color="#2ca02c", shape="hv"),
                                 hoverinfo="skip"))
    for number, name, color, symbol in ((current, "current settings", "#ff7f0e", "star"),
                                        (recommended, "recommended", "#d62728", "diamond")):
        if number is not None:
            points(shown[shown["trial"] == number], name, color, symbol, 16)
    if slo_ms:
        _lines(fig, [_vline(float(slo_ms), dict(color="#d62728", dash="dash"), f"SLO {slo_ms:g} ms")])
    fig.update_xaxes(title_text="p99 latency ms", rangemode="tozero")
    fig.update_yaxes(title_text="throughput req/s", rangemode="tozero")
    return fig
