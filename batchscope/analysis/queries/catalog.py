"""What a database holds, for the pickers and the event markers: the models and
instances known to it, and the events of a window."""

from __future__ import annotations

import json

import pandas as pd
from sqlalchemy import Engine, text

from batchscope.analysis.queries.window import Window, in_window, read_frame


def models(engine: Engine, instance_id: str | None = None) -> list[str]:
    """Models known from published settings and instance registrations."""
    names: set[str] = set()
    with engine.connect() as conn:
        q = "SELECT model FROM model_settings" + (" WHERE instance_id = :i" if instance_id else "")
        names.update(r[0] for r in conn.execute(text(q), {"i": instance_id}))
        q = "SELECT models_json FROM runtime_instances" + (" WHERE id = :i" if instance_id else "")
        for (raw,) in conn.execute(text(q), {"i": instance_id}):
            try:
                names.update(str(m) for m in json.loads(raw or "[]"))
            except (ValueError, TypeError):
                continue
    return sorted(names)


def model_kinds(engine: Engine, instance_id: str | None = None) -> dict[str, str]:
    """Each model's published kind ("request", "generate", ...) from ``model_settings``."""
    q = "SELECT model, kind FROM model_settings" + (" WHERE instance_id = :i" if instance_id else "")
    with engine.connect() as conn:
        return {str(m): str(k or "request") for m, k in conn.execute(text(q), {"i": instance_id})}


def instances(engine: Engine) -> pd.DataFrame:
    return read_frame(engine, "SELECT id, host, pid, models_json, url, device, version, started_at, "
                       "last_seen_at, stopped_at, records_dropped FROM runtime_instances "
                       "ORDER BY last_seen_at DESC", {})


def events(engine: Engine, w: Window, kinds: tuple[str, ...] | None = None,
           limit: int = 500) -> pd.DataFrame:
    """Events in the window (newest ``limit``), oldest first; includes model-less events."""
    parts = ["at >= :t0", "at < :t1"]
    params: dict = {"t0": w.start_s, "t1": w.end_s, "lim": limit}
    if w.model is not None:
        parts.append("(model = :model OR model IS NULL)")
        params["model"] = w.model
    if w.instance_id is not None:
        parts.append("instance_id = :inst")
        params["inst"] = w.instance_id
    if kinds:
        names = ", ".join(f":k{i}" for i in range(len(kinds)))
        parts.append(f"kind IN ({names})")
        params.update({f"k{i}": k for i, k in enumerate(kinds)})
    df = read_frame(engine, f"""
        SELECT * FROM (SELECT at, instance_id, model, kind, severity, message, details_json
                       FROM events WHERE {' AND '.join(parts)} ORDER BY at DESC, id DESC
                       LIMIT :lim) AS newest
        ORDER BY at""", params)
    return df


def event_counts(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = in_window(w, "at")
    return read_frame(engine, f"SELECT kind, COUNT(*) AS events FROM events WHERE {where} "
                       "GROUP BY kind ORDER BY kind", params)


def model_sources(engine: Engine, instance_id: str | None = None) -> pd.DataFrame:
    """What serves each model of each instance (its latest ``model_loaded`` event):
    instance_id, model, platform (``pytorch``, ``onnxruntime_onnx``, ...) and ``source``,
    a short text of where it was loaded from and with which options."""
    params: dict = {}
    only = ""
    if instance_id is not None:
        only = "AND instance_id = :inst"
        params["inst"] = instance_id
    df = read_frame(engine, f"""
        SELECT e.instance_id, e.model, e.details_json FROM events e
        JOIN (SELECT instance_id, model, MAX(at) AS at FROM events
              WHERE kind = 'model_loaded' {only} GROUP BY instance_id, model) latest
          ON e.instance_id = latest.instance_id AND e.model = latest.model AND e.at = latest.at
        WHERE e.kind = 'model_loaded'""", params)
    rows = []
    for inst, model, raw in zip(df["instance_id"], df["model"], df["details_json"]):
        details = json.loads(raw or "{}")
        source = details.get("source") or {}
        where = source.get("path") or ".".join(str(source[k]) for k in ("module", "class")
                                                if source.get(k))
        options = ", ".join(f"{k}={v}" for k, v in source.items()
                            if k not in ("path", "module", "class", "kind") and v not in (None, {}, []))
        rows.append({"instance_id": inst, "model": model,
                     "platform": details.get("platform", "pytorch"),
                     "source": where + (f" ({options})" if options else "")})
    return pd.DataFrame(rows, columns=["instance_id", "model", "platform", "source"]).drop_duplicates(
        ["instance_id", "model"])
