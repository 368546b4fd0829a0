"""Plotly figures of the fleet page: instances side by side, and the usage behind a
resource recommendation. ``DataFrame -> Figure`` like ``charts``, whose styling they share.
"""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from batchscope.analysis import recommend
from batchscope.presentation.charts import _axis, _base, _empty, _hline, _lines, _times

#: chart key -> title (``fleet_rules`` flags point at these keys)
FLEET_CHARTS: dict[str, str] = {
    "fleet_throughput": "Served requests per second, per instance",
    "fleet_latency": "Latency per instance, and of the whole fleet",
}
_SCALE = {"cores": (1.0, "cores"), "bytes": (1.0 / 2 ** 30, "GiB")}
#: the upper bound is drawn while it is at most this many times the target
UPPER_SHOWN = 3.0


def throughput_by_instance(timeline: pd.DataFrame) -> go.Figure:
    """One line per instance (``fleet.throughput_timeline``)."""
    if not len(timeline):
        return _empty(_base(FLEET_CHARTS["fleet_throughput"]))
    fig = _base(FLEET_CHARTS["fleet_throughput"], yaxis=_axis("req/s", rangemode="tozero"))
    x, y = _times(timeline["t"]).to_numpy(), timeline["ok_per_s"].to_numpy()
    fig.add_traces([go.Scatter(x=x[rows], y=y[rows], name=str(iid), mode="lines")
                    for iid, rows in sorted(timeline.groupby("instance_id").indices.items())])
    return fig


def latency_by_instance(table: pd.DataFrame, fleet_row: dict | None = None) -> go.Figure:
    """p50 and p99 bars per instance (``fleet.instance_table`` rows of one model), with the
    fleet-wide p50/p99 (exact over every instance's requests) as dashed lines."""
    rows = table.dropna(subset=["latency_p50_s"]) if len(table) else table
    if not len(rows):
        return _empty(_base(FLEET_CHARTS["fleet_latency"], closest=True))
    fig = _base(FLEET_CHARTS["fleet_latency"], closest=True, barmode="group",
                yaxis=_axis("ms", rangemode="tozero"))
    names = rows["instance_id"].astype(str)
    fig.add_traces([go.Bar(x=names, y=rows[col] * 1000.0, name=label, marker_color=color)
                    for col, label, color in (("latency_p50_s", "p50", "#1f77b4"),
                                              ("latency_p99_s", "p99", "#d62728"))])
    lines = []
    for key, label, color in (("latency_p50_s", "fleet p50", "#1f77b4"),
                              ("latency_p99_s", "fleet p99", "#d62728")):
        value = (fleet_row or {}).get(key)
        if value is not None and not math.isnan(float(value)):
            lines.append(_hline(float(value) * 1000.0, dict(color=color, dash="dash"), label))
    return _lines(fig, lines)


def upper_text(est: recommend.Estimate, scale: float, unit: str) -> str:
    """The upper bound in a few words: why there is none, or the figure (and why it is
    what it is) when it is too far above the target to draw."""
    if not math.isfinite(est.upper):
        return est.upper_note or "no upper bound yet"
    note = f", {est.upper_note}" if est.upper_note else ""
    return f"upper bound {est.upper * scale:,.1f} {unit}{note} (not drawn)"


def usage(series: dict[str, list[tuple[float, float]]], est: recommend.Estimate) -> go.Figure:
    """The recorded usage of each instance with the recommendation's lower bound,
    target and upper bound drawn across."""
    scale, unit = _SCALE.get(est.unit, (1.0, est.unit))
    # a short title (the chart sits in a third of the page); when the upper bound is not
    # drawn, a second, smaller line says what it is
    title = f"{est.resource.replace('_', ' ')}: usage and recommendation"
    off_chart = not math.isfinite(est.upper) or est.upper > UPPER_SHOWN * est.target
    if off_chart:
        note = upper_text(est, scale, unit)
        title += f"<br><span style='font-size:11px;color:#666'>{note}</span>"
    fig = _base(title, margin=dict(l=50, r=20, t=60 if off_chart else 40, b=40))
    if not any(series.values()):
        return _empty(fig, "no samples")
    for iid, points in sorted(series.items()):
        if points:
            fig.add_trace(go.Scatter(x=_times([t for t, _ in points]),
                                     y=[v * scale for _, v in points], name=iid, mode="lines"))
    fig.update_layout(yaxis=_axis(unit, rangemode="tozero"))
    return _lines(fig, [_hline(value * scale, dict(color="#444", dash=dash), label)
                        for value, label, dash in ((est.lower, "lower bound", "dot"),
                                                   (est.target, "target", "solid"),
                                                   (est.upper, "upper bound", "dash"))
                        if math.isfinite(value) and not (label == "upper bound" and off_chart)])
