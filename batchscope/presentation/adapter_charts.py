"""The LoRA adapters' charts of a live bundle (``queries.adapters``): throughput and
latency per adapter, batches by the number of adapters they mixed, the slot cache."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from batchscope.presentation.charts import _axis, _bar_axis, _base, _empty, _finite

#: chart key -> title, like ``charts.CHARTS``
ADAPTER_CHARTS: dict[str, str] = {
    "adapters": "Per adapter: throughput and latency",
    "adapter_mix": "Distinct adapters per batch",
    "adapter_slots": "Adapter slot cache",
}


def _label(name: str) -> str:
    return name or "(base)"


def per_adapter(ad: pd.DataFrame) -> go.Figure:
    """Answered requests per second (bars) and p50/p99 latency (points, right axis).

    Each axis gets its own range from its own traces, with room above the tallest bar
    or point, and its own round ticks: left to plotly, the right axis overlaying the
    left one syncs its ticks to the left one's (0 / 332 / 663 ms) and the tallest bar
    ends at the plot's top edge, above the last tick."""
    if ad is None or not len(ad):
        return _empty(_base(ADAPTER_CHARTS["adapters"], closest=True))
    x = [_label(a) for a in ad["adapter"]]
    rps = _finite(ad["rps"])
    ms = {p: _finite(ad[f"latency_p{p}"].astype("float64") * 1000.0) for p in (50, 99)}
    fig = _base(ADAPTER_CHARTS["adapters"], closest=True, barmode="group",
                yaxis=_bar_axis("requests/s", rps),
                yaxis2=_bar_axis("ms", np.concatenate(list(ms.values())), overlaying="y",
                                 side="right", tickmode="auto", showgrid=False))
    fig.add_trace(go.Bar(x=x, y=rps, name="throughput", marker_color="#1f77b4"))
    for p, color in ((50, "#2ca02c"), (99, "#d62728")):
        fig.add_trace(go.Scatter(x=x, y=ms[p], mode="markers", name=f"p{p}", yaxis="y2",
                                 marker=dict(color=color, size=9)))
    return fig


def adapter_mix(mix: pd.DataFrame) -> go.Figure:
    """Batches by the number of distinct adapters they mixed."""
    fig = _base(ADAPTER_CHARTS["adapter_mix"], closest=True,
                xaxis=_axis("distinct adapters in the batch", dtick=1),
                yaxis=_axis("batches", rangemode="tozero"))
    if mix is None or not len(mix):
        return _empty(fig)
    fig.add_trace(go.Bar(x=mix["adapters"], y=mix["batches"], name="batches",
                         marker_color="#9467bd"))
    return fig


def slot_cache(slots: pd.DataFrame) -> go.Figure:
    """The window's slot hits, misses (loads) and evictions."""
    fig = _base(ADAPTER_CHARTS["adapter_slots"], closest=True,
                yaxis=_axis("adapters", rangemode="tozero"))
    if slots is None or not len(slots):
        return _empty(fig)
    s = slots.iloc[0]
    fig.add_trace(go.Bar(x=["hits", "misses (loads)", "evictions"],
                         y=[s["hits"], s["misses"], s["evictions"]],
                         marker_color=["#2ca02c", "#ff7f0e", "#d62728"], name="slot cache",
                         hovertext=[None, None, f"{s['evictions_per_min']:.1f} per minute"]))
    return fig


def build_adapter_charts(bundle: dict) -> dict[str, go.Figure]:
    """The adapter charts of a bundle that has adapter frames (empty otherwise)."""
    if "adapters" not in bundle:
        return {}
    return {"adapters": per_adapter(bundle["adapters"]),
            "adapter_mix": adapter_mix(bundle.get("adapter_mix")),
            "adapter_slots": slot_cache(bundle.get("adapter_slots"))}
