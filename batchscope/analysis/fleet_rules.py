"""Diagnosis rules for a fleet: what only shows when instances are compared.

Each rule reads the bundle of ``fleet.bundle`` for one window and returns the flags it
finds (one per model or instance concerned; none when all is well), in the ``Flag``
shape of ``diagnosis``: the problem, how serious, the numbers that show it, the steps to
take and the chart to look at. Thresholds live in ``FleetThresholds``.

- ``imbalance``: one replica of a model is saturated (rejecting requests, or its queue
  holds several full batches) while another live replica of the same model idles.
- ``settings_drift``: live replicas of one model run different settings.
- ``stopped_reporting``: an instance that reported during the window has no heartbeat for
  longer than ``stale_after_s`` and never marked itself stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pandas as pd

from batchscope.analysis.flags import SEVERITY_ORDER, Flag, _num
from batchscope.analysis.fleet import LIVE, STALE

#: the chart keys of ``presentation.fleet_charts`` the flags point at
THROUGHPUT_CHART = "fleet_throughput"
TABLE_CHART = "fleet_table"


@dataclass(frozen=True)
class FleetThresholds:
    #: a replica needs this many requests in the window before its load is judged
    min_requests: int = 20
    #: saturated: at least this fraction of its requests rejected (429) ...
    saturated_rejected_fraction: float = 0.01
    #: ... or a mean queue depth of at least this many full batches
    saturated_queue_batches: float = 2.0
    #: idle: a mean queue depth at most this, no rejections, and ...
    idle_queue_depth: float = 1.0
    #: ... at most this fraction of the saturated replica's throughput
    idle_throughput_fraction: float = 0.5
    #: settings compared between replicas leave these out (none by default)
    ignored_settings: tuple[str, ...] = ()


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1000.0, 2)


def _replica(row: dict) -> dict:
    """The numbers of one replica a flag shows."""
    requests = _num(row.get("requests"))
    rejected = _num(row.get("rejected")) / requests if requests else 0.0
    return {"instance": row["instance_id"], "node": row.get("node"),
            "ok_per_s": round(_num(row.get("ok_per_s")), 2),
            "rejected_fraction": round(rejected, 4),
            "queue_depth_mean": round(_num(row.get("queue_depth_mean")), 2),
            "mean_batch_size": round(_num(row.get("mean_batch_size")), 2),
            "max_batch_size": int(_num(row.get("max_batch_size"))),
            "latency_p99_ms": _ms(_num(row.get("latency_p99_s"), math.nan))}


def _saturated(row: dict, th: FleetThresholds) -> bool:
    requests = _num(row.get("requests"))
    if requests < th.min_requests:
        return False
    rejected = _num(row.get("rejected")) / requests
    full = max(1.0, _num(row.get("max_batch_size"), 1.0))
    return (rejected >= th.saturated_rejected_fraction
            or _num(row.get("queue_depth_mean")) >= th.saturated_queue_batches * full)


def _idle(row: dict, busy: dict, th: FleetThresholds) -> bool:
    if _num(row.get("requests")) == 0:
        return True  # live and serving the model, yet it got nothing
    return (_num(row.get("rejected")) == 0
            and _num(row.get("queue_depth_mean")) <= th.idle_queue_depth
            and _num(row.get("ok_per_s"))
            <= th.idle_throughput_fraction * _num(busy.get("ok_per_s")))


def rule_imbalance(fb: dict, th: FleetThresholds) -> list[Flag]:
    table: pd.DataFrame = fb.get("table", pd.DataFrame())
    flags = []
    if not len(table):
        return flags
    live = table[table["state"] == LIVE]
    for model, group in live.groupby("model", sort=True):
        rows = group.to_dict("records")
        if len(rows) < 2:
            continue
        saturated = [r for r in rows if _saturated(r, th)]
        if not saturated:
            continue
        busy = max(saturated, key=lambda r: _num(r.get("queue_depth_mean")))
        hot = {r["instance_id"] for r in saturated}
        idle = [r for r in rows if r["instance_id"] not in hot and _idle(r, busy, th)]
        if not idle:
            continue
        total = sum(_num(r.get("requests")) for r in rows)
        share = _num(busy.get("requests")) / total if total else 0.0
        flags.append(Flag(
            "imbalance", "critical",
            f"Model {model}: replica {busy['instance_id']} is saturated while "
            f"{len(idle)} other replica(s) idle",
            {"model": model, "replicas": len(rows),
             "saturated": [_replica(r) for r in saturated], "idle": [_replica(r) for r in idle],
             "busiest_request_share": round(share, 3)},
            ["The router sends most requests to one replica. Behind a Kubernetes Service, "
             "long-lived keep-alive connections stay pinned to the pod they first reached: "
             "let clients open several connections, or put an HTTP-aware load balancer in "
             "front.",
             "Behind Ray Serve the router already weighs the replicas' ongoing requests "
             "(capped by max_ongoing_requests): an imbalance there points at a replica that "
             "is slower, not at the routing.",
             "Compare the replicas' settings and devices: a replica with a smaller "
             "max_batch_size or a slower device drains its queue more slowly and saturates "
             "first.",
             "If every replica is busy at peak, add replicas; if only this one is, fixing "
             "the routing is enough."],
            THROUGHPUT_CHART))
    return flags


def _differences(settings_by_instance: dict[str, dict], ignored: tuple[str, ...]) -> dict:
    """``{setting: {instance: value}}`` for the settings that are not the same everywhere."""
    keys = sorted({k for s in settings_by_instance.values() for k in s} - set(ignored))
    out = {}
    for key in keys:
        values = {iid: s.get(key) for iid, s in settings_by_instance.items()}
        if len({repr(v) for v in values.values()}) > 1:
            out[key] = values
    return out


def rule_settings_drift(fb: dict, th: FleetThresholds) -> list[Flag]:
    pub: pd.DataFrame = fb.get("settings", pd.DataFrame())
    inst: pd.DataFrame = fb.get("instances", pd.DataFrame())
    if not len(pub) or not len(inst):
        return []
    live = set(inst.loc[inst["state"] == LIVE, "id"])
    pub = pub[pub["instance_id"].isin(live)]
    flags = []
    for model, group in pub.groupby("model", sort=True):
        if len(group) < 2:
            continue
        by_instance = dict(zip(group["instance_id"], group["settings"]))
        diff = _differences(by_instance, th.ignored_settings)
        if not diff:
            continue
        versions = {iid: int(v) for iid, v in zip(group["instance_id"], group["version"])}
        names = ", ".join(diff)
        flags.append(Flag(
            "settings_drift", "warning",
            f"Model {model}: {len(group)} live replicas run different settings ({names})",
            {"model": model, "replicas": len(group), "settings_versions": versions,
             "differences": diff},
            ["Apply the change to every replica of the model at once (the Tuning page, "
             "instance 'all'), so each replica acknowledges the same settings.",
             "Look at the command acknowledgements: a replica may have refused the change "
             "(the reason is on its acknowledgement).",
             "A replica started after a change was applied begins with its own configuration "
             "and does not replay old changes: start replicas from the same configuration "
             "(--model-config) or send the change again."],
            TABLE_CHART))
    return flags


def rule_stopped_reporting(fb: dict, th: FleetThresholds) -> list[Flag]:
    inst: pd.DataFrame = fb.get("instances", pd.DataFrame())
    w = fb.get("window")
    if not len(inst) or w is None:
        return []
    table: pd.DataFrame = fb.get("table", pd.DataFrame())
    served = (table.groupby("instance_id")["requests"].sum().to_dict() if len(table) else {})
    flags = []
    stale = inst[(inst["state"] == STALE) & (inst["last_seen_at"] >= w.start_s)]
    for row in stale.to_dict("records"):
        iid = row["id"]
        requests = int(served.get(iid, 0))
        flags.append(Flag(
            "stopped_reporting", "critical" if requests else "warning",
            f"Instance {iid} stopped reporting {row['heartbeat_age_s']:.0f} s ago",
            {"instance": iid, "node": row.get("node"), "models": list(row.get("models", ())),
             "heartbeat_age_s": round(float(row["heartbeat_age_s"]), 1),
             "stale_after_s": fb.get("stale_after_s"), "requests_in_window": requests,
             "records_dropped": int(_num(row.get("records_dropped")))},
            ["It did not mark itself stopped, so it did not shut down cleanly: check whether "
             "the process, pod or node is still there (crash, OOM kill, eviction).",
             "If it still serves, it cannot reach the database: check the network path and "
             "the database's connection limit from that node.",
             "A router that still sends it requests fails them: take it out of rotation "
             "until it reports again."],
            TABLE_CHART))
    return flags


RULES: dict[str, Callable[[dict, FleetThresholds], list[Flag]]] = {
    "imbalance": rule_imbalance,
    "settings_drift": rule_settings_drift,
    "stopped_reporting": rule_stopped_reporting,
}


def diagnose(fleet_bundle: dict, thresholds: FleetThresholds | None = None) -> list[Flag]:
    """Run every fleet rule over one window's fleet bundle; most severe first."""
    th = thresholds or FleetThresholds()
    flags = [f for rule in RULES.values() for f in rule(fleet_bundle, th)]
    return sorted(flags, key=lambda f: SEVERITY_ORDER.get(f.severity, 9))
