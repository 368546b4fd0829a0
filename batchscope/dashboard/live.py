"""The Live page: headline numbers, charts and diagnosis of the scope's window.

Everything below the page header is one ``st.fragment`` that reruns every
``Scope.refresh_s`` seconds while the window is live, so only this region is
re-queried and redrawn; the sidebar and the other pages stay as they are.
"""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from batchscope.analysis import diagnosis, queries
from batchscope.dashboard.scope import Scope, data_engine, fmt_time, fragment
from batchscope.presentation import charts, report
from batchscope.presentation.adapter_charts import ADAPTER_CHARTS, build_adapter_charts

SEVERITY_ICON = {"critical": "🔴", "warning": "🟠", "info": "🔵"}
#: the order charts are drawn in, two to a row (those a bundle has no data for are left out)
CHART_ORDER = ("latency", "throughput", "wait_compute", "queue_depth", "batch_sizes",
               "batch_efficiency", "device", "padding", "priority", "model_share",
               "generation", "generation_latency")
#: the Live page's tabs. Their labels never change: Streamlit knows tabs by their labels,
#: so a count in a label ("Diagnosis (7)") made a new set of tabs whenever the count
#: changed, and a refresh showed Charts again; the count is said above the tabs instead
LIVE_TABS = ("Charts", "Diagnosis")
#: the session state key of the open tab, kept across refreshes and page runs
TAB_KEY = "live_tab"


def render(scope: Scope) -> None:
    fragment(live_region, scope.refresh_s)(data_engine(scope), scope)


def live_region(engine: Engine, scope: Scope) -> None:
    """One refresh: query the window, then draw the headline, charts and flags."""
    now = time.time()
    w = scope.window(now)
    bundle = cached_bundle(engine, w) if scope.live else queries.live_bundle(engine, w)
    head = bundle["headline"].iloc[0]
    st.caption(f"Window {fmt_time(w.start_s)} → {fmt_time(w.end_s)} · model "
               f"{w.model or 'all'} · {int(head['requests'])} requests, "
               f"{int(head['batches'])} batches · {head.get('resolution', '')} · "
               f"refreshed {fmt_time(now)}")
    if w.model is not None:
        served = cached_sources(engine, w.instance_id)
        served = served[served["model"] == w.model]
        if len(served):
            row = served.iloc[-1]
            st.caption(f"{w.model} is served by **{row['platform']}** from `{row['source']}`")
    render_headline(bundle)
    flags = diagnosis.diagnose(bundle)
    st.caption(findings_line(flags))
    chart_tab, flag_tab = live_tabs()
    with chart_tab:
        figs = render_charts(bundle, scope.slo_ms, "live")
    with flag_tab:
        render_flags(flags, figs, "live")


def live_tabs() -> tuple:
    """The Charts and Diagnosis tabs, the open one kept in the session (``TAB_KEY``).

    Tabs that track their state are sent with the open one selected, so it stays open when
    the region refreshes, when the findings change, and when a page run (another model in
    the sidebar) draws it at another place on the page.
    """
    return st.tabs(list(LIVE_TABS), key=TAB_KEY, on_change="rerun")


def findings_line(flags: list[diagnosis.Flag]) -> str:
    """How many findings the Diagnosis tab holds, by severity ("Diagnosis: 3 finding(s) ·
    🔴 1 critical · 🟠 2 warning"): the count its label no longer carries."""
    if not flags:
        return "Diagnosis: no problems found in this window."
    counts: dict[str, int] = {}
    for f in flags:  # diagnose() lists them most severe first
        counts[f.severity] = counts.get(f.severity, 0) + 1
    parts = " · ".join(f"{SEVERITY_ICON.get(sev, '')} {n} {sev}" for sev, n in counts.items())
    return f"Diagnosis: {len(flags)} finding(s) · {parts}"


def cached_bundle(engine: Engine, w: queries.Window) -> dict:
    """The live bundle, re-queried only when the last query is older than twice its cost."""
    key = (str(engine.url), w.duration_s, w.model, w.instance_id)
    return reused_while_fresh("bundle_cache", key, lambda: queries.live_bundle(engine, w))


def cached_sources(engine: Engine, instance_id: str | None) -> pd.DataFrame:
    """``queries.model_sources``, re-read like the bundle (it changes only at start-ups)."""
    return reused_while_fresh("sources_cache", (str(engine.url), instance_id),
                              lambda: queries.model_sources(engine, instance_id))


def reused_while_fresh(name: str, key: tuple, compute):
    """``compute()``, or what it gave last time for the same ``key`` while that is younger
    than twice what it took (kept in the session as ``name``).

    Short windows are re-queried on every refresh; long windows over large databases
    (a second or more per query) refresh less often so the server stays responsive.
    """
    last = st.session_state.get(name)
    now = time.monotonic()
    if last and last["key"] == key and now - last["at"] < 2.0 * last["cost_s"]:
        return last["value"]
    value = compute()
    st.session_state[name] = {"key": key, "value": value, "at": now, "cost_s": time.monotonic() - now}
    return value


def render_headline(bundle: dict) -> None:
    items = report.headline_items(bundle["headline"].iloc[0])
    for row in range(0, len(items), 6):  # a shorter last row spreads out: long values fit
        part = items[row:row + 6]
        for col, (label, value) in zip(st.columns(len(part)), part):
            col.metric(label, value, border=True)


def render_charts(bundle: dict, slo_ms: float, prefix: str) -> dict:
    figs = charts.build_all(bundle, slo_ms=slo_ms)
    keys = [k for k in CHART_ORDER if k in figs]
    for i in range(0, len(keys), 2):
        cols = st.columns(2)
        for col, key in zip(cols, keys[i:i + 2]):
            col.plotly_chart(figs[key], key=f"{prefix}-{key}", config={"displaylogo": False})
    adapter_figs = build_adapter_charts(bundle)
    if adapter_figs:  # a window with LoRA adapter traffic
        st.subheader("LoRA adapters")
        keys = list(ADAPTER_CHARTS)
        for i in range(0, len(keys), 2):
            cols = st.columns(2)
            for col, key in zip(cols, keys[i:i + 2]):
                col.plotly_chart(adapter_figs[key], key=f"{prefix}-{key}",
                                 config={"displaylogo": False})
        figs = {**figs, **adapter_figs}
    return figs


def render_flags(flags: list[diagnosis.Flag], figs: dict | None, prefix: str) -> None:
    """Each flag as an expander: its evidence, the steps to take, and the chart it is about."""
    if not flags:
        st.success("No problems found in this window.")
        return
    for i, f in enumerate(flags):
        with st.expander(f"{SEVERITY_ICON.get(f.severity, '')} {f.title}", expanded=i < 2):
            st.caption(f"rule `{f.rule}` · severity {f.severity} · chart: "
                       f"{charts.CHARTS.get(f.chart, f.chart)}")
            left, right = st.columns([2, 3])
            left.dataframe(pd.DataFrame({"evidence": [str(v) for v in f.evidence.values()]},
                                        index=list(f.evidence)), width="stretch")
            right.markdown("\n".join(f"{n}. {s}" for n, s in enumerate(f.steps, 1)))
            if figs and f.chart in figs:
                st.plotly_chart(figs[f.chart], key=f"{prefix}-flag-{i}-{f.chart}")
