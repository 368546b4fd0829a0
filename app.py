"""BatchScope dashboard: ``streamlit run app.py``.

Wiring only: queries, charts, diagnosis, snapshots and the control store live
in ``batchscope``. With no runtime reporting to the configured database the app
starts the bundled demo runtime (once per server process; ``BATCHSCOPE_NO_DEMO=1``
or the sidebar toggle turns that off).
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from batchscope.presentation import charts, report, snapshot
from batchscope.storage import control, db
from batchscope.analysis import diagnosis, queries

ROOT = Path(__file__).resolve().parent
WINDOWS_MIN = {"1 min": 1.0, "5 min": 5.0, "15 min": 15.0, "60 min": 60.0}
SEVERITY_ICON = {"critical": "🔴", "warning": "🟠", "info": "🔵"}
POLICIES = ("static", "dynamic", "adaptive")

st.set_page_config(page_title="BatchScope", page_icon="📦", layout="wide")
# headline numbers sit six to a row: a smaller value font keeps "50.3 ms" or
# "1.67 GiB" whole instead of cut to "50.3 …" on a laptop-sized window
st.markdown("<style>[data-testid='stMetricValue']{font-size:1.6rem}"
            "[data-testid='stMetricLabel'] p{font-size:0.8rem}</style>", unsafe_allow_html=True)


# -- resources (one per Streamlit server process) ------------------------------------
@st.cache_resource(show_spinner=False)
def engine_for(url: str):
    return db.make_engine(url)


class DemoRuntime:
    """The bundled demo runtime as a child process, stopped when the app exits."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        if not (ROOT / "runtime" / "demo.py").exists():
            self.error = "the demo runtime (runtime/tools/demo.py) is not part of this checkout"
            return
        self.log_path = Path(tempfile.gettempdir()) / "batchscope-demo-runtime.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.tools.demo", "--db", url, "--port", "0"],
            cwd=str(ROOT), stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "BATCHSCOPE_DB_URL": url})
        atexit.register(self.stop)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@st.cache_resource(show_spinner=False)
def demo_runtime(url: str) -> DemoRuntime:
    return DemoRuntime(url)


def default_db_url() -> str:
    if os.environ.get(db.ENV_URL):
        return os.environ[db.ENV_URL]
    try:
        return str(st.secrets["BATCHSCOPE_DB_URL"])
    except (KeyError, FileNotFoundError, st.errors.StreamlitSecretNotFoundError):
        return db.default_url()


# -- sidebar --------------------------------------------------------------------------
def sidebar() -> dict:
    sb = st.sidebar
    sb.title("BatchScope")
    url = sb.text_input("Database URL", value=default_db_url(), key="db_url")
    demo_default = os.environ.get("BATCHSCOPE_NO_DEMO", "") not in ("1", "true", "yes")
    demo_ok = sb.toggle("Start the demo runtime when nothing reports", value=demo_default,
                        key="demo_on")
    snaps = st.session_state.get("snapshots", {})
    sources = ["Live database"] + [f"Snapshot: {name}" for name in snaps]
    if "switch_source" in st.session_state:  # a snapshot was just opened: browse it
        st.session_state["source"] = st.session_state.pop("switch_source")
    source = sb.radio("Data", sources, key="source")
    return {"url": url, "demo": demo_ok, "source": source}


def pick_scope(engine, *, live: bool, snap: snapshot.Snapshot | None) -> dict:
    sb = st.sidebar
    inst_rows = queries.instances(engine)
    now = time.time()
    live_rows = control.live_instances(engine, now=now) if live else []
    live_ids = [i.id for i in live_rows]
    demo_ids = [i.id for i in live_rows if (i.version or "").endswith("-demo")]
    inst_ids = list(inst_rows["id"]) if len(inst_rows) else []
    options = ["all"] + inst_ids
    default = options.index(live_ids[0]) if live_ids and live_ids[0] in options else 0
    inst = sb.selectbox("Instance", options, index=default, key="instance",
                        format_func=lambda i: i + (" (live)" if i in live_ids else ""))
    inst_id = None if inst == "all" else inst
    names = queries.models(engine, inst_id)
    # start on a batching model: its charts are the ones every view fills
    kinds = queries.model_kinds(engine, inst_id)
    first = next((i for i, n in enumerate(names) if kinds.get(n, "request") != "generate"), 0)
    model = sb.selectbox("Model", names or ["(none yet)"], index=first, key="model")
    model = None if model == "(none yet)" else model
    if snap is not None:
        w = snap.window
        window = queries.Window(w.start_s, w.end_s, model, inst_id)
        sb.caption(f"Snapshot window: {fmt_time(w.start_s)} → {fmt_time(w.end_s)}")
        return {"window": window, "live": False, "model": model, "instance": inst_id,
                "live_ids": live_ids, "demo_ids": demo_ids, "names": names, "minutes": w.duration_s / 60,
                "end_ago_min": 0.0}
    choice = sb.radio("Time window", list(WINDOWS_MIN) + ["custom"], index=2, horizontal=True,
                      key="window_choice")
    end_ago = 0.0
    if choice == "custom":
        minutes = sb.number_input("Window length (minutes)", 0.5, 24 * 60.0, 30.0, key="custom_min")
        end_ago = sb.number_input("Ending this many minutes ago", 0.0, 7 * 24 * 60.0, 0.0,
                                  key="custom_end")
    else:
        minutes = WINDOWS_MIN[choice]
    return {"window": None, "live": end_ago == 0.0, "model": model, "instance": inst_id,
            "live_ids": live_ids, "demo_ids": demo_ids, "names": names, "minutes": float(minutes),
            "end_ago_min": float(end_ago)}


def current_window(scope: dict) -> queries.Window:
    if scope["window"] is not None:
        return scope["window"]
    end = time.time() - scope["end_ago_min"] * 60.0
    return queries.Window.last(scope["minutes"], now=end, model=scope["model"],
                               instance_id=scope["instance"])


def fmt_time(seconds: float) -> str:
    return dt.datetime.fromtimestamp(float(seconds)).strftime("%Y-%m-%d %H:%M:%S")


# -- live view ------------------------------------------------------------------------
def render_headline(bundle: dict) -> None:
    head = bundle["headline"].iloc[0]
    items = report.headline_items(head)
    cols = st.columns(6)
    for i, (label, value) in enumerate(items):
        cols[i % 6].metric(label, value, border=True)


def render_charts(bundle: dict, slo_ms: float, prefix: str) -> dict:
    figs = charts.build_all(bundle, slo_ms=slo_ms)
    order = ["latency", "throughput", "wait_compute", "queue_depth", "batch_sizes",
             "batch_efficiency", "device", "padding", "priority", "model_share",
             "generation", "generation_latency"]
    keys = [k for k in order if k in figs]
    for i in range(0, len(keys), 2):
        cols = st.columns(2)
        for col, key in zip(cols, keys[i:i + 2]):
            col.plotly_chart(figs[key], key=f"{prefix}-{key}", config={"displaylogo": False})
    return figs


def render_flags(flags: list[diagnosis.Flag], figs: dict | None, prefix: str) -> None:
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


def cached_bundle(engine, w: queries.Window) -> dict:
    """The live bundle, re-queried only when the last query is older than twice its cost.

    Short windows are re-queried on every refresh; long windows over large databases
    (a second or more per query) refresh less often so the server stays responsive.
    """
    key = (str(engine.url), w.duration_s, w.model, w.instance_id)
    last = st.session_state.get("bundle_cache")
    now = time.monotonic()
    if last and last["key"] == key and now - last["at"] < 2.0 * last["cost_s"]:
        return last["bundle"]
    bundle = queries.live_bundle(engine, w)
    st.session_state["bundle_cache"] = {"key": key, "bundle": bundle, "at": now,
                                        "cost_s": time.monotonic() - now}
    return bundle


def live_view(engine, scope: dict, slo_ms: float) -> None:
    w = current_window(scope)
    bundle = cached_bundle(engine, w) if scope["live"] else queries.live_bundle(engine, w)
    head = bundle["headline"].iloc[0]
    st.caption(f"Window {fmt_time(w.start_s)} → {fmt_time(w.end_s)} · model "
               f"{w.model or 'all'} · {int(head['requests'])} requests, "
               f"{int(head['batches'])} batches · refreshed {fmt_time(time.time())}")
    render_headline(bundle)
    flags = diagnosis.diagnose(bundle)
    tabs = st.tabs([f"Charts", f"Diagnosis ({len(flags)})"])
    with tabs[0]:
        figs = render_charts(bundle, slo_ms, "live")
    with tabs[1]:
        render_flags(flags, figs, "live")


# -- tuning ---------------------------------------------------------------------------
def _settings_for(engine, scope: dict) -> tuple[str | None, int | None, dict]:
    model = scope["model"]
    candidates = [scope["instance"]] if scope["instance"] else scope["live_ids"]
    if not candidates:
        inst = queries.instances(engine)
        candidates = list(inst["id"]) if len(inst) else []
    for inst_id in candidates:
        found = control.current_settings(engine, inst_id, model)
        if found is not None:
            return inst_id, found[0], found[1]
    return None, None, {}


def _parse_ints(text: str, what: str) -> list[int]:
    text = text.strip()
    if not text:
        return []
    try:
        return [int(x) for x in text.replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be whole numbers separated by commas, e.g. 8, 16, 32") from None


def tuning_form(engine, scope: dict) -> None:
    model = scope["model"]
    if model is None:
        st.info("No model has reported yet; tuning appears once a runtime publishes its settings.")
        return
    inst_id, version, cur = _settings_for(engine, scope)
    st.caption(f"Current settings of **{model}**" + (f" on {inst_id}, version {version}" if inst_id
                                                     else " (none published yet)"))
    target = scope["instance"]
    if cur and "max_batch_size" not in cur:  # e.g. a generation model's own settings
        generic_form(engine, model, target, cur)
        return
    with st.form("tuning"):
        c1, c2, c3 = st.columns(3)
        policy = c1.selectbox("Policy", POLICIES,
                              index=POLICIES.index(cur.get("policy", "dynamic"))
                              if cur.get("policy") in POLICIES else 1)
        max_bs = c1.number_input("Max batch size", 1, 4096, int(cur.get("max_batch_size") or 32))
        delay = cur.get("max_queue_delay_ms")
        auto = c2.checkbox("Max queue delay: auto (work-conserving)", value=delay is None)
        delay_ms = c2.number_input("Max queue delay (ms)", 0.0, 60_000.0,
                                   float(delay if delay is not None else 5.0))
        preferred = c2.text_input("Preferred batch sizes",
                                  ", ".join(str(x) for x in cur.get("preferred_batch_sizes") or []))
        edges = c3.text_input("Bucket edges",
                              ", ".join(str(x) for x in cur.get("bucket_edges") or []))
        levels = c3.number_input("Priority levels", 1, 16, int(cur.get("priority_levels") or 3))
        default_prio = c3.number_input("Default priority", 0, 15, int(cur.get("default_priority") or 0))
        timeout = cur.get("default_timeout_ms")
        timeout_ms = c1.number_input("Default timeout (ms, 0 = none)", 0.0, 3_600_000.0,
                                     float(timeout or 0.0))
        submitted = st.form_submit_button("Apply", type="primary")
    if submitted:
        try:
            wanted = {"policy": policy, "max_batch_size": int(max_bs),
                      "max_queue_delay_ms": None if auto else float(delay_ms),
                      "preferred_batch_sizes": _parse_ints(preferred, "Preferred batch sizes"),
                      "bucket_edges": _parse_ints(edges, "Bucket edges"),
                      "priority_levels": int(levels), "default_priority": int(default_prio),
                      "default_timeout_ms": float(timeout_ms) if timeout_ms > 0 else None}
        except ValueError as exc:
            st.error(str(exc))
            return
        if not wanted["bucket_edges"]:
            wanted.pop("bucket_edges")
        changes = {k: v for k, v in wanted.items() if cur.get(k) != v} if cur else wanted
        if not changes:
            st.info("Nothing differs from the current settings.")
            return
        cid = control.request_change(engine, model=model, changes=changes,
                                     requested_by="dashboard", instance_id=target)
        st.session_state["last_command"] = cid
        st.toast(f"Requested change #{cid}: {json.dumps(changes)}")


def _parse_value(text: str, like):
    """A text field back into the type of the current value ('' or 'null' = null)."""
    text = text.strip()
    if text in ("", "null", "none", "auto"):
        return None
    if isinstance(like, list):
        return _parse_ints(text, "this setting")
    try:
        return json.loads(text)
    except ValueError:
        return text


def generic_form(engine, model: str, target: str | None, cur: dict) -> None:
    """One field per published setting, for models whose settings are not batching ones."""
    with st.form("tuning-generic"):
        cols = st.columns(3)
        wanted = {}
        for i, (key, value) in enumerate(cur.items()):
            col = cols[i % 3]
            if isinstance(value, bool):
                wanted[key] = col.checkbox(key, value=value)
            elif isinstance(value, int):
                wanted[key] = int(col.number_input(key, value=value, step=1))
            elif isinstance(value, float):
                wanted[key] = float(col.number_input(key, value=value))
            else:
                shown = "" if value is None else (", ".join(map(str, value))
                                                  if isinstance(value, list) else str(value))
                wanted[key] = (col.text_input(key, shown), value)
        submitted = st.form_submit_button("Apply", type="primary")
    if not submitted:
        return
    try:
        wanted = {k: (_parse_value(*v) if isinstance(v, tuple) else v) for k, v in wanted.items()}
    except ValueError as exc:
        st.error(str(exc))
        return
    changes = {k: v for k, v in wanted.items() if cur.get(k) != v}
    if not changes:
        st.info("Nothing differs from the current settings.")
        return
    cid = control.request_change(engine, model=model, changes=changes, requested_by="dashboard",
                                 instance_id=target)
    st.session_state["last_command"] = cid


def command_status_view(engine) -> None:
    cid = st.session_state.get("last_command")
    if cid is None:
        return
    try:
        cmd = control.command_status(engine, cid)
    except ValueError as exc:
        st.warning(str(exc))
        return
    text = json.dumps(cmd.changes)
    if cmd.status == control.PENDING:
        st.info(f"Change #{cmd.id} {text}: pending — waiting for the runtime to apply it.")
    elif cmd.status == control.APPLIED:
        st.success(f"Change #{cmd.id} {text}: applied as settings version {cmd.applied_version}.")
    else:
        st.error(f"Change #{cmd.id} {text}: refused — {cmd.reason}")


def history_and_revert(engine, scope: dict, slo_ms: float) -> None:
    model = scope["model"]
    if model is None:
        return
    hist = control.settings_history(engine, model, scope["instance"], limit=100)
    st.subheader("Settings history")
    if not hist:
        st.caption("No settings changes recorded for this model.")
        return
    table = pd.DataFrame([{"when": fmt_time(h.at), "instance": h.instance_id, "version": h.version,
                           "by": h.requested_by, "old": json.dumps(h.old), "new": json.dumps(h.new)}
                          for h in hist])
    st.dataframe(table, hide_index=True, width="stretch")
    labels = {f"v{h.version} at {fmt_time(h.at)}: {json.dumps(h.new)}": h for h in hist}
    choice = st.selectbox("Change", list(labels), key="revert_choice")
    chosen = labels[choice]
    c1, c2 = st.columns(2)
    if c1.button("Revert to the settings before this change", key="revert"):
        cid = control.request_change(engine, model=model, changes=chosen.old,
                                     requested_by="dashboard (revert)",
                                     instance_id=scope["instance"])
        st.session_state["last_command"] = cid
        st.toast(f"Requested revert #{cid}: {json.dumps(chosen.old)}")
    span = scope["minutes"] * 60.0
    before = queries.Window(chosen.at - span, chosen.at, model, scope["instance"])
    after = queries.Window(chosen.at, min(time.time(), chosen.at + span), model, scope["instance"])
    hb, ha = queries.headline(engine, before), queries.headline(engine, after)
    c2.caption(f"Before/after: {span / 60:.0f} min on each side of the change "
               f"(after covers {after.duration_s / 60:.1f} min so far)")
    st.plotly_chart(charts.compare(hb, ha), key="before-after")


# -- snapshots ------------------------------------------------------------------------
def snapshot_tab(engine, scope: dict, slo_ms: float) -> None:
    st.subheader("Export")
    st.caption("One .zip with the window's batches, requests, events, device samples, generation "
               "steps, settings, the flags found, the environment and an offline HTML report.")
    if st.button("Prepare snapshot of the current window", key="prep_snap"):
        w = current_window(scope)
        with st.spinner("Exporting…"):
            st.session_state["snap_bytes"] = snapshot.export_bytes(engine, w, slo_ms=slo_ms)
    data = st.session_state.get("snap_bytes")
    if data:
        st.download_button("Download snapshot", data, file_name="batchscope-snapshot.zip",
                           mime="application/zip", key="dl_snap")
    st.subheader("Open")
    files = st.file_uploader("Open snapshot(s) — two to compare", type=["zip"],
                             accept_multiple_files=True, key="upload")
    snaps = st.session_state.setdefault("snapshots", {})
    opened = None
    for f in files or []:
        if f.name in snaps or f.name in st.session_state.get("snap_errors", {}):
            continue
        try:
            snaps[f.name] = snapshot.load_snapshot(f.getvalue())
            opened = f.name
        except snapshot.SnapshotError as exc:
            st.session_state.setdefault("snap_errors", {})[f.name] = str(exc)
    for name, err in st.session_state.get("snap_errors", {}).items():
        st.error(f"{name} was not opened: {err}")
    if opened is not None:
        st.session_state["switch_source"] = f"Snapshot: {opened}"
        st.rerun()
    if snaps:
        st.caption("Opened: " + ", ".join(snaps) + " — pick one under Data in the sidebar.")
    if len(snaps) >= 2:
        compare_snapshots(snaps, slo_ms)


def compare_snapshots(snaps: dict, slo_ms: float) -> None:
    st.subheader("Compare")
    names = list(snaps)
    c1, c2 = st.columns(2)
    a = c1.selectbox("Left", names, index=0, key="cmp_a")
    b = c2.selectbox("Right", names, index=1, key="cmp_b")
    bundles = {}
    for col, name in ((c1, a), (c2, b)):
        s = snaps[name]
        bundles[name] = queries.live_bundle(s.engine, s.window)
        with col:
            h = bundles[name]["headline"].iloc[0]
            for label, value in report.headline_items(h)[:6]:
                st.metric(label, value)
            st.plotly_chart(charts.latency(bundles[name]["requests_t"], bundles[name]["events"],
                                           slo_ms), key=f"cmp-lat-{col is c1}")
    st.plotly_chart(charts.compare(bundles[a]["headline"], bundles[b]["headline"], labels=(a, b)),
                    key="cmp-bars")


# -- page -----------------------------------------------------------------------------
def rerun_when_runtimes_change(engine, scope: dict) -> None:
    """Rebuild the whole page (sidebar included) when runtimes or models appear or go:
    the live view refreshes on its own, but the Instance and Model pickers are drawn
    once per page run and would otherwise keep showing "(none yet)" after a runtime
    (e.g. the auto-started demo) begins reporting."""
    live_ids = [i.id for i in control.live_instances(engine, now=time.time())]
    names = queries.models(engine, scope["instance"])
    if live_ids != scope["live_ids"] or names != scope["names"]:
        st.rerun(scope="app")


def main() -> None:
    opts = sidebar()
    engine = engine_for(opts["url"])
    snaps = st.session_state.get("snapshots", {})
    snap = None
    if opts["source"].startswith("Snapshot: "):
        snap = snaps.get(opts["source"][len("Snapshot: "):])
    data_engine = snap.engine if snap is not None else engine
    scope = pick_scope(data_engine, live=snap is None, snap=snap)
    slo_ms = st.sidebar.number_input("Latency SLO (ms)", 1.0, 600_000.0, 50.0, key="slo_ms")
    refresh_s = st.sidebar.select_slider("Refresh every (s)", [1.0, 1.5, 2.0], 2.0, key="refresh")
    paused = st.sidebar.toggle("Pause live refresh", value=False, key="paused")

    st.title("BatchScope")
    if snap is not None:
        st.info(f"Browsing snapshot {opts['source'][10:]} (not live).")
    elif scope["live_ids"] and scope.get("demo_ids") == scope["live_ids"]:
        st.info("Live data from the bundled demo runtime (models mlp, encoder and decoder under "
                "synthetic, varying traffic), started because no other runtime was reporting to "
                f"{opts['url']}. Turn it off with BATCHSCOPE_NO_DEMO=1 or the sidebar toggle.")
    elif scope["live_ids"]:
        st.caption(f"Attached to live runtime(s): {', '.join(scope['live_ids'])}")
    elif opts["demo"]:
        demo = demo_runtime(opts["url"])
        if demo.error:
            st.warning(f"No runtime reports to {opts['url']} and {demo.error}.")
        elif demo.running():
            st.info(f"No runtime was reporting to {opts['url']}, so the bundled demo runtime was "
                    f"started (pid {demo.proc.pid}) with synthetic traffic. Turn this off with "
                    "BATCHSCOPE_NO_DEMO=1 or the sidebar toggle.")
        else:
            st.error(f"The demo runtime exited; see {demo.log_path}.")
    else:
        st.warning(f"No runtime is reporting to {opts['url']}; showing recorded data only.")

    live = snap is None and scope["live"] and not paused
    if live:
        st.fragment(run_every=2.0)(rerun_when_runtimes_change)(engine, scope)
    tabs = st.tabs(["Live", "Tuning", "Snapshots"])
    with tabs[0]:
        st.fragment(run_every=refresh_s if live else None)(live_view)(data_engine, scope, slo_ms)
    with tabs[1]:
        if snap is not None:
            st.caption("Tuning acts on the live database; switch Data back to it.")
        else:
            tuning_form(engine, scope)
            st.fragment(run_every=1.0 if live else None)(command_status_view)(engine)
            history_and_revert(engine, scope, slo_ms)
    with tabs[2]:
        snapshot_tab(data_engine, scope, slo_ms)


# Streamlit runs this file as ``__main__``. A multiprocessing "spawn" child started
# later from the same process (the device or database-writer process) imports the
# parent's ``__main__`` again, as ``__mp_main__``: it must not render the app or
# start a demo runtime.
if __name__ != "__mp_main__":
    main()
