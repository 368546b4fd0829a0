"""Self-contained offline HTML report of one window (Plotly JS inlined once).

Everything shown comes from the same query bundle and chart builders as the
dashboard: the headline, the diagnosis (the window's flags and the fleet's), the charts,
the settings changes, the resource recommendations, the tuning sessions with their
trials charts and the golden-parameter table beside the published rows
(``batchscope.tuning.golden``). Every piece of recorded text is HTML-escaped.
"""

from __future__ import annotations

import datetime as _dt
import html
import json

import pandas as pd

from batchscope.presentation import charts
from batchscope.analysis.diagnosis import Flag
from batchscope.tuning import golden
from batchscope.tuning.space import format_point

#: the sessions whose trials chart the report draws (the newest)
TUNING_CHARTS = 5

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.sub{color:#666;font-size:13px} table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ddd;padding:4px 8px;text-align:left} th{background:#f5f5f5}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:8px}
.metric{border:1px solid #e3e3e3;border-radius:6px;padding:8px} .metric b{display:block;font-size:20px}
.flag{border-left:5px solid #999;padding:6px 12px;margin:10px 0;background:#fafafa}
.critical{border-color:#d62728} .warning{border-color:#ff9f1c} .info{border-color:#1f77b4}
"""


def _fmt_time(seconds: float) -> str:
    return _dt.datetime.fromtimestamp(float(seconds), _dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def _val(v, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "—"
    return f"{float(v) * scale:,.{digits}f}{unit}"


def _ms(v) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "—"
    ms = float(v) * 1000
    return f"{ms:.2f} ms" if ms < 10 else (f"{ms:.1f} ms" if ms < 100 else f"{ms:,.0f} ms")


def headline_items(head: pd.Series | dict) -> list[tuple[str, str]]:
    """(label, text) pairs of the headline numbers, shared by the app and the report."""
    h = dict(head)
    return [
        ("served req/s", _val(h.get("ok_per_s"))),
        ("batches/s", _val(h.get("batches_per_s"))),
        ("latency p50", _ms(h.get("latency_p50"))),
        ("latency p95", _ms(h.get("latency_p95"))),
        ("latency p99", _ms(h.get("latency_p99"))),
        ("mean batch / max", f"{_val(h.get('mean_batch_size'), digits=2)} / "
                             f"{_val(h.get('max_batch_size'), digits=0)}"),
        ("queue depth", _val(h.get("queue_depth_last"), digits=0)),
        ("device utilization", _val(h.get("utilization_mean_pct"), " %")),
        ("memory peak", _val(h.get("memory_used_max_bytes"), " GiB", 1 / 2 ** 30, 2)),
        ("rejected/expired/errors", f"{int(h.get('rejected') or 0)} / "
                                        f"{int(h.get('expired') or 0)} / {int(h.get('errors') or 0)}"),
        ("recorder drops", _val(h.get("records_dropped"), digits=0)),
    ]


def _flag_html(f: Flag | dict) -> str:
    d = f.to_dict() if isinstance(f, Flag) else f
    ev = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                 for k, v in (d.get("evidence") or {}).items())
    steps = "".join(f"<li>{html.escape(str(s))}</li>" for s in d.get("steps") or [])
    sev = html.escape(str(d.get("severity", "info")))
    return (f'<div class="flag {sev}"><b>[{sev}] {html.escape(str(d.get("title", "")))}</b> '
            f'<span class="sub">rule {html.escape(str(d.get("rule", "")))}, see chart '
            f'"{html.escape(charts.CHARTS.get(d.get("chart", ""), d.get("chart", "")))}"</span>'
            f"<table>{ev}</table><ol>{steps}</ol></div>")


def _table(header: list[str], rows: list[list]) -> str:
    """An HTML table of text cells (every cell escaped)."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _estimate(est: dict | None, scale: float, unit: str, digits: int) -> str:
    if not isinstance(est, dict) or not isinstance(est.get("target"), (int, float)):
        return "—"
    return _val(est["target"], unit, scale, digits)


def recommendations_html(recs: list) -> str:
    """The resource recommendations of the manifest (targets; bounds in the manifest)."""
    rows = [[f"{r.get('scope', '')} {r.get('key', '')}",
             _estimate(r.get("cpu"), 1.0, " cores", 2),
             _estimate(r.get("memory"), 1 / 2 ** 30, " GiB", 2),
             _estimate(r.get("gpu_memory"), 1 / 2 ** 30, " GiB", 2),
             "; ".join(str(n) for n in r.get("notes") or [])]
            for r in recs if isinstance(r, dict)]
    if not rows:
        return "<p>No usage was recorded in this window.</p>"
    return _table(["for", "CPU", "memory", "GPU memory", "notes"], rows)


def tuning_html(sessions: list, trials: dict, *, first_chart: bool) -> str:
    """The stored tuning sessions (newest first), the newest ones' trials charts, and the
    golden-parameter table beside the published rows. ``first_chart``: no chart came
    before, so the first one here carries Plotly's script."""
    if not sessions:
        return "<p>No tuning session was stored in this window.</p>"
    rows = [[s.id, _fmt_time(s.started_at), s.model, s.instance_id or "", s.hardware or "",
             s.state, s.trials,
             "" if s.recommended is None else (format_point(s.recommended) or "(starting)"),
             s.sentence or s.stop_reason or ""] for s in sessions]
    parts = [_table(["session", "started", "model", "instance", "hardware", "state", "trials",
                     "best", "result"], rows)]
    drawn = [s for s in sessions if trials.get(s.id)][:TUNING_CHARTS]
    for i, s in enumerate(drawn):
        fig = charts.tuning_trials(pd.DataFrame([t.row() for t in trials[s.id]]),
                                   slo_ms=s.slo_p99_ms, recommended=s.best_trial)
        fig.update_layout(title_text=f"Tuning session #{s.id}: {s.model}")
        parts.append(f'<div id="tuning-{s.id}">' + fig.to_html(
            full_html=False, include_plotlyjs=first_chart and i == 0,
            config={"displaylogo": False}) + "</div>")
    best_of = {s.id: s.best_trial for s in sessions}
    best = {sid: t for sid, ts in trials.items() for t in ts if best_of.get(sid) == t.number}
    found = golden.golden_rows(sessions, best)
    parts.append("<h3>Golden parameters</h3>")
    parts.append(_table(list(golden.COLUMNS), [golden.cells(r) for r in found]) if found else
                 "<p>No session found a setting that meets its SLO.</p>")
    parts.append("<h3>Published rules of thumb</h3>")
    parts.append(_table(list(golden.ARTICLE_COLUMNS), golden.article_cells()))
    return "".join(parts)


def render_html(bundle: dict[str, pd.DataFrame], flags: list, *, manifest: dict | None = None,
                slo_ms: float | None = None, title: str = "BatchScope report",
                sessions: list | None = None, trials: dict | None = None) -> str:
    """The report; ``sessions`` (``store.StoredSession``, newest first) and ``trials``
    (their ``store.StoredTrial`` lists by session id) fill its tuning section."""
    manifest = manifest or {}
    window = manifest.get("window") or {}
    figs = charts.build_all(bundle, slo_ms=slo_ms)
    parts = []
    for i, (key, fig) in enumerate(figs.items()):
        parts.append(f'<div id="chart-{html.escape(key)}">' + fig.to_html(
            full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False}) + "</div>")
    head = bundle["headline"].iloc[0] if len(bundle["headline"]) else {}
    metrics = "".join(f'<div class="metric">{html.escape(label)}<b>{html.escape(text)}</b></div>'
                      for label, text in headline_items(head))
    flags_html = "".join(_flag_html(f) for f in flags) or "<p>No problems found in this window.</p>"
    fleet_html = "".join(_flag_html(f) for f in manifest.get("fleet_flags") or []
                         if isinstance(f, dict)) or "<p>No fleet problems found in this window.</p>"
    ev = bundle.get("events")
    changes = ev[ev["kind"] == "settings_change"] if ev is not None and len(ev) else None
    change_rows = "".join(
        f"<tr><td>{_fmt_time(r.at)}</td><td>{html.escape(str(r.model))}</td>"
        f"<td>{html.escape(str(r.message))}</td></tr>" for r in changes.itertuples()
    ) if changes is not None and len(changes) else ""
    env = manifest.get("environment") or {}
    span = (f"{_fmt_time(window['start_s'])} → {_fmt_time(window['end_s'])}"
            if "start_s" in window else "")
    scope = f"model {window.get('model') or 'all'}, instance {window.get('instance_id') or 'all'}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<div class="sub">{html.escape(span)} — {html.escape(scope)}</div>
<h2>Headline</h2><div class="grid">{metrics}</div>
<h2>Diagnosis</h2>{flags_html}
<h2>Fleet diagnosis</h2>{fleet_html}
<h2>Charts</h2>{''.join(parts)}
<h2>Settings changes</h2>
<table><tr><th>when</th><th>model</th><th>change</th></tr>{change_rows}</table>
<h2>Resource recommendations</h2>{recommendations_html(manifest.get("recommendations") or [])}
<h2>Tuning sessions</h2>{tuning_html(sessions or [], trials or {}, first_chart=not parts)}
<h2>Environment</h2><pre>{html.escape(json.dumps(env, indent=1, default=str))}</pre>
</body></html>"""
