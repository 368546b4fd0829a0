"""The Fleet page: every instance recording into the database, side by side.

The top region is one ``st.fragment`` refreshed like the Live page: instance states
(live, stale, stopped), one row per instance of the picked model (settings version,
throughput, p50/p99, mean batch size, queue depth, device utilization), the model's
fleet-wide percentiles (exact, over every instance's requests), the per-instance charts
and the fleet diagnosis. The page opens on the model and instance with the most traffic
in the window, unless the sidebar's model has traffic.

Below it, outside the refresh, the resource recommendations (``analysis.recommend``)
per model and per instance with their evidence, and the ``VerticalPodAutoscaler`` and
``resources:`` YAML to download.
"""

from __future__ import annotations

import json
import math
import os
import time

import pandas as pd
import streamlit as st
import yaml
from sqlalchemy import Engine

from batchscope.analysis import fleet, fleet_rules, recommend
from batchscope.analysis import queries
from batchscope.analysis.queries import Window
from batchscope.dashboard.live import render_flags, reused_while_fresh
from batchscope.dashboard.scope import Scope, data_engine, fmt_time, fragment
from batchscope.deploy import k8s
from batchscope.presentation import fleet_charts

STATE_ICON = {fleet.LIVE: "🟢 live", fleet.STALE: "🟠 stale", fleet.STOPPED: "⚪ stopped",
              fleet.UNREGISTERED: "❔ unregistered"}
HISTORY = {"8 days (VPA's history)": 8 * 86400.0, "24 hours": 86400.0, "the scope's window": None}
GIB = 2 ** 30
#: seconds a computed recommendation is reused (its history is days long)
REUSE_S = 30.0


def render(scope: Scope) -> None:
    engine = data_engine(scope)
    fragment(fleet_region, scope.refresh_s)(engine, scope)
    st.divider()
    recommendations(engine, scope)


def _now(scope: Scope) -> float:
    """The clock the states are judged by: now, or the end of a past window/snapshot."""
    return time.time() if scope.live else scope.end_s


def _fleet_window(scope: Scope, now: float) -> Window:
    w = scope.window(now)
    return Window(w.start_s, w.end_s)  # every instance and model


def pick(options: list[str], preferred: str | None, fallback: str | None) -> int:
    """The index to open a picker on: the preferred entry when listed, else the fallback."""
    for choice in (preferred, fallback):
        if choice in options:
            return options.index(choice)
    return 0


# -- the live region ----------------------------------------------------------------------
def fleet_region(engine: Engine, scope: Scope) -> None:
    now = _now(scope)
    w = _fleet_window(scope, now)
    if scope.live:  # a long window over a busy fleet costs a second or more: see reused_while_fresh
        fb = reused_while_fresh("fleet_cache", (str(engine.url), w.duration_s),
                                lambda: fleet.bundle(engine, w, now=now))
    else:
        fb = fleet.bundle(engine, w, now=now)
    inst, table = fb["instances"], fb["table"]
    counts = inst["state"].value_counts().to_dict() if len(inst) else {}
    states = ", ".join(f"{counts.get(s, 0)} {s}" for s in (fleet.LIVE, fleet.STALE, fleet.STOPPED))
    st.caption(f"Window {fmt_time(w.start_s)} → {fmt_time(w.end_s)} · {len(inst)} instance(s): "
               f"{states} · stale after {fb['stale_after_s']:g} s without a heartbeat · "
               "figures from the per-second summaries, percentiles exact")
    if not len(table):
        st.info("No instance has registered or recorded anything yet.")
        return
    busiest = fb["busiest"]
    traffic = set(table.loc[table["requests"] > 0, "model"])
    models = sorted(set(table["model"]))
    preferred = scope.model if scope.model in traffic else None
    model = st.selectbox("Model", models, key="fleet_model",
                         index=pick(models, preferred, busiest[1] if busiest else None))
    rows = table[table["model"] == model]
    served = queries.model_sources(engine)
    rows = rows.merge(served[served["model"] == model][["instance_id", "platform", "source"]],
                      on="instance_id", how="left")
    if "device" in inst.columns:  # the device string each instance registered with
        rows = rows.merge(inst.rename(columns={"id": "instance_id"})[["instance_id", "device"]],
                          on="instance_id", how="left")
    render_model_headline(fb["fleet"], model, rows)
    st.dataframe(display_table(rows), hide_index=True, width="stretch")
    timeline = fleet.throughput_timeline(engine, Window(w.start_s, w.end_s, model))
    fleet_row = fb["fleet"][fb["fleet"]["model"] == model]
    figs = {"fleet_throughput": fleet_charts.throughput_by_instance(timeline),
            "fleet_latency": fleet_charts.latency_by_instance(
                rows, fleet_row.iloc[0].to_dict() if len(fleet_row) else None)}
    left, right = st.columns(2)
    left.plotly_chart(figs["fleet_throughput"], key="fleet-throughput")
    right.plotly_chart(figs["fleet_latency"], key="fleet-latency")
    flags = fleet_rules.diagnose(fb)
    st.markdown(f"**Fleet diagnosis ({len(flags)})**")
    render_flags(flags, figs, "fleet")
    render_instance(fb, rows, busiest)


def render_model_headline(per_model: pd.DataFrame, model: str, rows: pd.DataFrame) -> None:
    row = per_model[per_model["model"] == model]
    r = row.iloc[0].to_dict() if len(row) else {}
    live = int((rows["state"] == fleet.LIVE).sum())
    cols = st.columns(6)
    cols[0].metric("replicas live / all", f"{live} / {len(rows)}", border=True)
    cols[1].metric("served req/s (fleet)", f"{float(r.get('ok_per_s', 0.0)):.1f}", border=True)
    for col, p in zip(cols[2:5], (50, 95, 99)):
        col.metric(f"fleet p{p}", _ms(r.get(f"latency_p{p}_s")), border=True,
                   help="exact: the percentile of every ok request of the model in the window, "
                        "all instances ranked together")
    cols[5].metric("rejected (fleet)", f"{int(r.get('rejected', 0) or 0)}", border=True)


def _ms(seconds) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "–"
    return f"{float(seconds) * 1000.0:.1f} ms"


def mps_label(device) -> str:
    """Whether an instance shares its GPU through CUDA MPS, from the device string it
    registered with (``cuda:0 · MPS 50% threads``): "on" with the share when known,
    "off" on a GPU without it, "–" on the CPU or when unknown."""
    if not isinstance(device, str) or not device:
        return "–"
    head, _, tail = device.partition("· MPS")
    if _:
        share = tail.strip()
        return f"on · {share}" if share else "on"
    return "off" if head.strip().startswith("cuda") else "–"


def display_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The per-instance rows as the page shows them (units in the headers)."""
    out = pd.DataFrame({
        "instance": rows["instance_id"], "node": rows["node"],
        "served by": rows["platform"] if "platform" in rows else None,
        "state": rows["state"].map(lambda s: STATE_ICON.get(s, s)),
        "MPS": rows["device"].map(mps_label) if "device" in rows else "–",
        "heartbeat age (s)": rows["heartbeat_age_s"].round(1),
        "settings version": rows["settings_version"],
        "served req/s": rows["ok_per_s"].round(2),
        "p50 (ms)": (rows["latency_p50_s"] * 1000.0).round(2),
        "p99 (ms)": (rows["latency_p99_s"] * 1000.0).round(2),
        "mean batch": rows["mean_batch_size"].round(2),
        "max batch": rows["max_batch_size"],
        "queue depth (mean)": rows["queue_depth_mean"].round(2),
        "queue depth (last)": rows["queue_depth_last"],
        "device util (%)": rows["utilization_mean_pct"].round(1),
        "rejected": rows["rejected"], "expired": rows["expired"], "errors": rows["errors"],
    })
    return out.reset_index(drop=True)


def render_instance(fb: dict, rows: pd.DataFrame, busiest: tuple[str, str] | None) -> None:
    ids = list(rows["instance_id"])
    by_traffic = rows.sort_values("requests", ascending=False)["instance_id"].tolist()
    preferred = busiest[0] if busiest and busiest[0] in ids else None
    iid = st.selectbox("Instance", ids, key="fleet_instance",
                       index=pick(ids, preferred, by_traffic[0] if by_traffic else None))
    inst = fb["instances"]
    meta = inst[inst["id"] == iid]
    pub = fb["settings"]
    mine = pub[(pub["instance_id"] == iid) & pub["model"].isin(rows["model"])]
    left, right = st.columns(2)
    if len(meta):
        m = meta.iloc[0]
        left.markdown(
            f"**{iid}** on `{m.get('node')}` · {STATE_ICON.get(m['state'], m['state'])} · "
            f"last heartbeat {fmt_time(m['last_seen_at'])} ({m['heartbeat_age_s']:.0f} s ago) · "
            f"device {m.get('device')} · version {m.get('version')} · started "
            f"{fmt_time(m['started_at'])}")
    else:
        left.markdown(f"**{iid}** recorded rows but never registered")
    if len(mine):
        right.caption(f"settings v{int(mine.iloc[0]['version'])}, published "
                      f"{fmt_time(mine.iloc[0]['updated_at'])}")
        right.json(mine.iloc[0]["settings"], expanded=False)


# -- recommendations ----------------------------------------------------------------------
def recommendations(engine: Engine, scope: Scope) -> None:
    st.subheader("Resource recommendations")
    st.caption("Computed as the Kubernetes VPA recommender does: decaying histograms "
               "(half-life 24 h), p90 target, p50 lower and p95 upper bound, 15 % margin, "
               "memory raised after an out-of-memory event; GPU memory alongside, which VPA "
               "has no resource for. The lower bound stays wide until history backs it, as "
               "in VPA. An upper bound needs a day of history (VPA's 1 + 1/days factor would "
               "make it hundreds of times the usage after minutes) and is at most what the "
               "host or device has.")
    left, right = st.columns(2)
    history = left.radio("History", list(HISTORY), horizontal=True, key="rec_history",
                         index=2 if scope.snapshot is not None else 0)
    registered = recommend.registered_host_cpus(engine)
    host_cpus = right.number_input("CPUs per serving host", 1, 4096,
                                   registered or os.cpu_count() or 1, key="rec_host_cpus",
                                   help="The CPU sampler records host-wide utilization; this "
                                        "turns it into cores. It starts at the CPU count the "
                                        "instances registered" + ("" if registered else
                                        " (they differ or did not say: this machine's)"))
    end = _now(scope)
    if scope.live:  # a whole step, so reruns within it reuse the computed history
        end = math.floor(end / REUSE_S) * REUSE_S
    span = HISTORY[history]
    start = scope.start_s if span is None else end - span
    usage, recs = cached_recommendations(engine, str(engine.url), start, end, float(host_cpus))
    if not recs:
        st.info("No device samples, batches or requests recorded in this history yet.")
        return
    st.dataframe(recommendation_table(recs), hide_index=True, width="stretch")
    names = [r.name for r in recs]
    wanted = st.session_state.get("fleet_model")
    choice = st.selectbox("Evidence for", names, key="rec_pick",
                          index=pick(names, f"model {wanted}", None))
    render_evidence(recs[names.index(choice)], usage)


@st.cache_data(ttl=REUSE_S, show_spinner="Reading the recorded usage…", max_entries=8)
def cached_recommendations(_engine: Engine, url: str, start_s: float, end_s: float,
                           host_cpus: float) -> tuple[dict, list]:
    """Usage and recommendations of one history, kept ``REUSE_S`` (keyed by the URL: the
    engine itself is not hashed)."""
    options = recommend.VpaOptions()
    usage = recommend.load_usage(_engine, start_s, end_s, options=options, host_cpus=host_cpus)
    return usage, recommend.from_usage(usage, start_s=start_s, end_s=end_s, options=options,
                                       host_cpus=host_cpus)


def _bounds(est: recommend.Estimate | None) -> str:
    if est is None:
        return "–"
    fmt = recommend.cpu_quantity if est.unit == "cores" else recommend.memory_quantity
    upper = fmt(est.upper) if math.isfinite(est.upper) else "none yet (< 1 day of history)"
    return f"{fmt(est.lower)} / {fmt(est.target)} / {upper}"


def recommendation_table(recs: list[recommend.Recommendation]) -> pd.DataFrame:
    return pd.DataFrame([{
        "for": r.name, "instances": len(r.instances),
        "CPU lower / target / upper": _bounds(r.cpu),
        "memory lower / target / upper": _bounds(r.memory),
        "GPU memory lower / target / upper": _bounds(r.gpu_memory),
        "history (days)": round(max((e.confidence_days for e in (r.cpu, r.memory, r.gpu_memory)
                                     if e is not None), default=0.0), 3),
    } for r in recs])


def evidence_table(rec: recommend.Recommendation) -> pd.DataFrame:
    rows = []
    for est in (rec.cpu, rec.memory, rec.gpu_memory):
        if est is None:
            continue
        scale = 1.0 if est.unit == "cores" else 1.0 / GIB
        unit = "cores" if est.unit == "cores" else "GiB"
        rows.append({
            "resource": est.resource, "measured": est.source, "samples": est.samples,
            "interval peaks": est.peaks, "OOM bumps": est.oom_bumps,
            "max seen": round(est.max_observed * scale, 3), "unit": unit,
            "p50 / p90 / p95": " / ".join(f"{v * scale:.3f}" for v in (est.p50, est.p90, est.p95)),
            "history (days)": round(est.confidence_days, 4),
            "first sample": fmt_time(est.first_sample_s) if est.first_sample_s else "–",
            "last sample": fmt_time(est.last_sample_s) if est.last_sample_s else "–",
        })
    return pd.DataFrame(rows)


def render_evidence(rec: recommend.Recommendation, usage: dict[str, recommend.Usage]) -> None:
    st.markdown(f"**{rec.name}** · instances {', '.join(rec.instances)} · models "
                f"{', '.join(rec.models) or '–'} · from {fmt_time(rec.start_s)} to "
                f"{fmt_time(rec.end_s)}")
    for note in rec.notes:
        st.warning(note)
    st.dataframe(evidence_table(rec), hide_index=True, width="stretch")
    found = [r for r in (recommend.CPU, recommend.MEMORY, recommend.GPU_MEMORY)
             if getattr(rec, r) is not None]
    for col, res in zip(st.columns(len(found)) if found else [], found):
        series = {iid: getattr(usage[iid], res) for iid in rec.instances if iid in usage}
        col.plotly_chart(fleet_charts.usage(series, getattr(rec, res)), key=f"rec-usage-{res}")
    model = rec.key if rec.scope == "model" else (rec.models[0] if rec.models else rec.key)
    spec = k8s.Spec(model=model, name=k8s.default_name(model),
                    device="cuda" if rec.gpu_memory is not None else "cpu")
    block = yaml.safe_dump({"resources": k8s.container_resources(spec, rec)}, sort_keys=False)
    manifest = k8s.to_yaml([k8s.vpa(spec, rec)], k8s.provenance(rec, model))
    measured = [r for r in ("cpu", "memory") if getattr(rec, r) is not None]
    defaults = [r for r in ("cpu", "memory") if r not in measured]
    st.caption("resources: " + (f"{' and '.join(measured)} from the recorded usage" if measured
                                else "nothing measured")
               + (f"; {' and '.join(defaults)} at the defaults of batchscope k8s" if defaults else "")
               + ("; one GPU" if rec.gpu_memory is not None else ""))
    st.code(block, language="yaml")
    left, right, third = st.columns(3)
    left.download_button("VerticalPodAutoscaler (YAML)", manifest,
                         file_name=f"{spec.name}-vpa.yaml", mime="application/yaml",
                         key="dl-vpa")
    right.download_button("resources: block (YAML)", block,
                          file_name=f"{spec.name}-resources.yaml", mime="application/yaml",
                          key="dl-resources")
    third.download_button("recommendation with evidence (JSON)",
                          json.dumps(rec.to_dict(), indent=1, allow_nan=False),
                          file_name=f"{spec.name}-recommendation.json",
                          mime="application/json", key="dl-rec-json")
