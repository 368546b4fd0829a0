"""Diagnosis rules: pure functions over query results -> ``Flag``.

Each rule reads the bundle of ``queries.live_bundle`` for one window and either
returns ``None`` or a ``Flag`` naming the problem, how serious it is, the
numbers that show it, the chart to look at and concrete steps to take.
Thresholds live in ``Thresholds`` so they can be tuned and tested.

The rules of every model are here; those of generation models are in
``rules_generation``, those of models with adapters in ``rules_adapters``, and ``Flag``,
``Thresholds`` and the shared helpers in ``flags``. ``RULES`` names them all and
``diagnose`` runs them.
"""

from __future__ import annotations

import math
from typing import Callable

import pandas as pd

from batchscope.analysis.flags import (OOM_KINDS, SEVERITY_ORDER, Flag, Thresholds, _enough,
                                       _head, _ms, _num, json_object)
from batchscope.analysis.rules_adapters import (rule_adapter_mixing_off, rule_adapter_starving,
                                                rule_adapter_thrash)
from batchscope.analysis.rules_generation import (rule_long_prefill_stall,
                                                  rule_preemption_thrash,
                                                  rule_speculation_not_paying)

__all__ = ["Flag", "Thresholds", "SEVERITY_ORDER", "OOM_KINDS", "RULES", "diagnose",
           "rule_adapter_mixing_off", "rule_adapter_starving", "rule_adapter_thrash",
           "rule_long_prefill_stall", "rule_preemption_thrash", "rule_speculation_not_paying"]


# -- rules ---------------------------------------------------------------------------
def rule_oom(bundle: dict, th: Thresholds) -> Flag | None:
    h = _head(bundle)
    ev = bundle.get("events", pd.DataFrame(columns=["kind"]))
    ooms = ev[ev["kind"].isin(OOM_KINDS)] if len(ev) else ev
    used, total = _num(h.get("memory_used_max_bytes")), _num(h.get("memory_total_bytes"))
    frac = used / total if total else 0.0
    if not len(ooms) and frac < th.memory_near_fraction:
        return None
    evidence = {"oom_events": int(len(ooms)), "memory_peak_gib": round(used / 2 ** 30, 2),
                "memory_total_gib": round(total / 2 ** 30, 2),
                "memory_peak_fraction": round(frac, 3)}
    if len(ooms):
        last = ooms.iloc[-1]
        details = json_object(last.get("details_json"))
        evidence.update({"batch_size_at_failure": details.get("batch_size"),
                         "runtime_action": str(last.get("message", ""))})
        title = f"Out of memory {len(ooms)} time(s) in this window"
        severity = "critical"
    else:
        title = f"Device memory reached {frac:.0%} of its capacity"
        severity = "warning"
    steps = [
        "Lower max_batch_size below the size that failed (the runtime already backs off; make "
        "it permanent so it stops probing into the failure).",
        "Turn on length bucketing or refine bucket_edges so long inputs are not batched with "
        "many others; activation memory grows with batch size × padded length.",
        "Check what else holds device memory (other models on the device, cached allocator "
        "blocks) on the device chart.",
        "Consider a smaller or distilled model, or half precision, to cut weight and "
        "activation memory.",
    ]
    return Flag("oom", severity, title, evidence, steps, "device")


def rule_repeated_oom(bundle: dict, th: Thresholds) -> Flag | None:
    ev = bundle.get("events", pd.DataFrame(columns=["kind"]))
    ooms = ev[ev["kind"].isin(OOM_KINDS)] if len(ev) else ev
    if len(ooms) < th.repeated_oom_count:
        return None
    span = float(ooms["at"].max() - ooms["at"].min())
    return Flag("repeated_oom", "critical", f"Repeated out-of-memory: {len(ooms)} events",
                {"oom_events": int(len(ooms)), "span_s": round(span, 1),
                 "mean_gap_s": round(span / max(1, len(ooms) - 1), 1)},
                ["The backed-off batch size keeps probing back up into the failure: lower "
                 "max_batch_size to the size that last succeeded.",
                 "Raise oom_probe_after_batches so the runtime probes less often.",
                 "If inputs vary in length, bucket them so one long input cannot blow up a "
                 "whole batch."], "device")


def rule_tail_latency(bundle: dict, th: Thresholds) -> Flag | None:
    h = _head(bundle)
    p50, p99 = _num(h.get("latency_p50"), math.nan), _num(h.get("latency_p99"), math.nan)
    if math.isnan(p50) or math.isnan(p99) or p50 <= 0 or p99 < th.tail_min_p99_s:
        return None
    ratio = p99 / p50
    if ratio < th.tail_ratio:
        return None
    tail = bundle.get("tail")
    wait = _num(tail.iloc[0]["queue_wait_mean_s"]) if tail is not None and len(tail) else 0.0
    comp = _num(tail.iloc[0]["compute_mean_s"]) if tail is not None and len(tail) else 0.0
    dominant = "queue wait" if wait >= comp else "compute"
    steps = ([
        "Shorten max_queue_delay_ms (or set it to auto) so requests do not wait for companions.",
        "Send latency-critical requests at the most urgent priority (engine priority 0, "
        "HTTP priority 1) or through the bypass lane.",
        "Switch to the adaptive policy so the wait follows the measured compute time.",
        "If the queue is long, add capacity: the tail is requests queued behind full batches.",
    ] if dominant == "queue wait" else [
        "The slow requests spend their time computing: look for large or long batches (bucket "
        "lengths, cap max_batch_size).",
        "Check the device chart for contention with other models or throttling.",
    ])
    return Flag("tail_latency", "warning", f"p99 latency is {ratio:.1f}× p50; {dominant} dominates "
                "the tail",
                {"latency_p50_ms": _ms(p50), "latency_p99_ms": _ms(p99), "ratio": round(ratio, 1),
                 "tail_queue_wait_mean_ms": _ms(wait), "tail_compute_mean_ms": _ms(comp),
                 "dominant": dominant}, steps, "latency")


def rule_batches_not_forming(bundle: dict, th: Thresholds) -> Flag | None:
    """Small batches with a larger maximum: too few requests in flight, or, when requests
    queue or are turned away meanwhile, a limit that ends batches early (then raising
    client concurrency would only make the queue longer)."""
    h = _head(bundle)
    mean, mx = _num(h.get("mean_batch_size")), _num(h.get("max_batch_size"))
    if not _enough(h, th) or mx < th.not_forming_min_max_size or mean > th.not_forming_mean_size:
        return None
    backlog = _backlog(bundle, h)
    if _backed_up(backlog, th):
        return _batches_capped(bundle, backlog, mean, mx)
    rate = _num(h.get("ok_per_s"))
    lat = (_num(h.get("queue_wait_mean_s")) + _num(h.get("compute_mean_s")))
    in_flight = rate * lat
    return Flag("batches_not_forming", "warning",
                f"Batches are not forming: mean size {mean:.2f} with max {int(mx)}",
                {"mean_batch_size": round(mean, 2), "max_batch_size": int(mx),
                 "arrival_req_per_s": round(rate, 1), "mean_latency_ms": _ms(lat),
                 "requests_in_flight": round(in_flight, 2), "concurrency_needed": int(mx)},
                [f"Only about {in_flight:.1f} requests are in flight at once (arrival rate × "
                 f"latency); filling batches of {int(mx)} needs about {int(mx)} concurrent "
                 "requests. Raise client concurrency or send requests asynchronously.",
                 "If the load is what it is, batching cannot help: a small max_queue_delay_ms "
                 "(or auto) keeps latency low without waiting for companions that never come.",
                 "If clients are many but each waits for its answer, check that they are not "
                 "serialised behind one connection."], "batch_sizes")


def _backlog(bundle: dict, h: dict) -> dict:
    """How far requests back up in the window: refused, expired, queue depth."""
    bt = bundle.get("batches_t")
    depth_max = (_num(bt["queue_depth_max"].max()) if bt is not None and len(bt)
                 and "queue_depth_max" in bt else 0.0)
    return {"requests": _num(h.get("requests")), "rejected": _num(h.get("rejected")),
            "expired": _num(h.get("expired")), "queue_depth_mean": _num(h.get("queue_depth_mean")),
            "queue_depth_max": depth_max}


def _backed_up(backlog: dict, th: Thresholds) -> bool:
    refused = backlog["rejected"] + backlog["expired"]
    return (backlog["queue_depth_mean"] >= th.not_forming_queued_depth
            or (refused > 0 and refused >= th.rejected_fraction * backlog["requests"]))


def _oom_caps(bundle: dict) -> dict:
    """The window's out-of-memory events: how many, how many a configured memory budget
    raised (``memory_budget_mb``: an estimate refused, not the memory running out), and
    the effective max batch size the last one left."""
    ev = bundle.get("events")
    if ev is None or not len(ev):
        return {"oom_events": 0, "budget_ooms": 0, "effective_max_batch_size": None}
    ooms = ev[ev["kind"].isin(OOM_KINDS)]
    details = [json_object(d) for d in ooms.get("details_json", pd.Series(dtype=object))]
    budget = sum("memory budget" in str(d.get("error", "")) or "memory_budget_mb" in
                 str(d.get("error", "")) for d in details)
    caps = [d.get("effective_max_batch_size") for d in details
            if d.get("effective_max_batch_size") is not None]
    return {"oom_events": int(len(ooms)), "budget_ooms": int(budget),
            "effective_max_batch_size": caps[-1] if caps else None}


def _batches_capped(bundle: dict, backlog: dict, mean: float, mx: float) -> Flag:
    """Small batches while requests queue: name the limits the data points at."""
    ooms = _oom_caps(bundle)
    pad = bundle.get("padding")  # variable-length batches only: a fixed shape has no tokens
    batches = float(pad["batches"].sum()) if pad is not None and len(pad) else 0.0
    per_batch = float(pad["padded_elements"].sum()) / batches if batches else None
    steps = []
    if ooms["budget_ooms"]:
        steps.append(f"{ooms['budget_ooms']} batch(es) were over the configured memory budget "
                     "(memory_budget_mb): the runtime splits them and backs the batch size "
                     f"off (effective max now {ooms['effective_max_batch_size']}). Raise "
                     "memory_budget_mb if the host has the memory, or bucket lengths so "
                     "short inputs are not padded to long ones.")
    elif ooms["oom_events"]:
        steps.append(f"{ooms['oom_events']} out-of-memory event(s): the runtime backed the batch "
                     f"size off (effective max now {ooms['effective_max_batch_size']}); see "
                     "the out-of-memory flag.")
    if per_batch is not None:
        steps.append(f"Batches compute about {per_batch:.0f} padded elements (tokens) each: a "
                     "max_batch_tokens near that ends them early. Raise it, or bucket "
                     "lengths / pad_to=batch_max so fewer of those tokens are padding.")
    steps += ["Requests are waiting, so client concurrency is not what keeps batches small: "
              "check max_batch_tokens, memory_budget_mb and max_queue_delay_ms (a wait "
              "that dispatches before companions are taken from the queue).",
              "Until batches grow, the model serves fewer requests than arrive: see the "
              "saturation flag, shed load early or add capacity."]
    return Flag("batches_capped", "warning",
                f"Batches stay small while requests queue: mean size {mean:.2f} of max "
                f"{int(mx)}",
                {"mean_batch_size": round(mean, 2), "max_batch_size": int(mx),
                 "rejected": int(backlog["rejected"]), "expired": int(backlog["expired"]),
                 "queue_depth_mean": round(backlog["queue_depth_mean"], 1),
                 "queue_depth_max": int(backlog["queue_depth_max"]),
                 "padded_elements_per_batch": None if per_batch is None else round(per_batch, 1),
                 **ooms}, steps, "batch_sizes")


def rule_queue_wait_low_load(bundle: dict, th: Thresholds) -> Flag | None:
    h = _head(bundle)
    if not _enough(h, th):
        return None
    wait, comp = _num(h.get("queue_wait_mean_s")), _num(h.get("compute_mean_s"))
    util = _num(h.get("utilization_mean_pct"), 100.0)
    mean, mx = _num(h.get("mean_batch_size")), _num(h.get("max_batch_size"), 1.0)
    low_load = util < th.low_load_utilization_pct or mean <= th.low_load_size_fraction * mx
    queued = _backed_up(_backlog(bundle, h), th)  # the wait is for a turn, not companions
    if comp <= 0 or wait < th.wait_over_compute * comp or not low_load \
            or _num(h.get("rejected")) > 0 or queued:
        return None
    return Flag("queue_wait_low_load", "warning",
                f"Queue wait ({_ms(wait)} ms) dominates compute ({_ms(comp)} ms) at low load",
                {"queue_wait_mean_ms": _ms(wait), "compute_mean_ms": _ms(comp),
                 "utilization_mean_pct": round(util, 1), "mean_batch_size": round(mean, 2),
                 "max_batch_size": int(mx)},
                ["Requests wait for companions that rarely arrive: lower max_queue_delay_ms or set "
                 "it to auto (dispatch at once while the model is idle).",
                 "Or use the adaptive policy, whose wait follows the measured compute time."],
                "wait_compute")


def rule_saturation(bundle: dict, th: Thresholds) -> Flag | None:
    h = _head(bundle)
    total, rejected = _num(h.get("requests")), _num(h.get("rejected"))
    bt = bundle.get("batches_t")
    first = last = 0.0
    if bt is not None and len(bt) >= 3 and not bt["queue_depth_mean"].isna().all():
        third = max(1, len(bt) // 3)
        first = _num(bt["queue_depth_mean"].iloc[:third].mean())
        last = _num(bt["queue_depth_mean"].iloc[-third:].mean())
    mx = _num(h.get("max_batch_size"), 1.0)
    growing = last >= th.queue_growth_factor * max(first, 1.0) and last >= 4 * mx
    frac = rejected / total if total else 0.0
    if frac < th.rejected_fraction and not growing:
        return None
    return Flag("saturation", "critical",
                "Saturated: " + ("requests are being rejected" if frac >= th.rejected_fraction
                                 else "the queue keeps growing"),
                {"rejected": int(rejected), "rejected_fraction": round(frac, 4),
                 "queue_depth_start": round(first, 1), "queue_depth_end": round(last, 1),
                 "served_req_per_s": round(_num(h.get("ok_per_s")), 1),
                 "utilization_mean_pct": round(_num(h.get("utilization_mean_pct")), 1)},
                ["Arrivals exceed what the model serves. Raise max_batch_size if larger batches "
                 "still add throughput (see items per compute second), otherwise add replicas "
                 "or a faster device.",
                 "Shed load early: a smaller max_queue_size or a default_timeout_ms fails "
                 "requests fast instead of letting every request wait.",
                 "Give critical traffic the most urgent priority (engine 0, HTTP 1) so it is "
                 "served first under overload."],
                "queue_depth")


def rule_padding_waste(bundle: dict, th: Thresholds) -> Flag | None:
    pad = bundle.get("padding")
    if pad is None or not len(pad) or pad["batches"].sum() < th.min_batches:
        return None
    real, padded = float(pad["real_elements"].sum()), float(pad["padded_elements"].sum())
    waste = 1.0 - real / padded if padded else 0.0
    if waste < th.padding_waste_fraction:
        return None
    worst = pad.sort_values("waste_fraction").iloc[-1]
    return Flag("padding_waste", "warning", f"{waste:.0%} of computed elements are padding",
                {"waste_fraction": round(waste, 3), "real_elements": int(real),
                 "padded_elements": int(padded), "worst_bucket": int(worst["bucket"]),
                 "worst_bucket_waste_fraction": round(float(worst["waste_fraction"]), 3)},
                ["Turn on length bucketing and add bucket edges inside the worst bucket so "
                 "requests of similar length are batched together.",
                 "Pad to the longest request in the batch (pad_to=batch_max) rather than to "
                 "the bucket edge."], "padding")


def rule_diminishing_returns(bundle: dict, th: Thresholds) -> Flag | None:
    sizes = bundle.get("batch_sizes")
    if sizes is None or not len(sizes) or sizes.get("items_per_compute_s") is None \
            or sizes["items_per_compute_s"].isna().all():  # roll-ups keep no compute per size
        return None
    ok = sizes[sizes["batches"] >= th.diminishing_min_batches_per_size]
    if len(ok) < 3:
        return None
    hi = ok.iloc[-1]
    if hi["batch_size"] < 8:
        return None
    half = ok[ok["batch_size"] <= 0.6 * hi["batch_size"]]
    if not len(half):
        return None
    lo = half.iloc[(half["batch_size"] - hi["batch_size"] / 2).abs().argmin()]
    gain = float(hi["items_per_compute_s"] / lo["items_per_compute_s"])
    if gain >= th.diminishing_gain:
        return None
    best = float(ok["items_per_compute_s"].max())
    knee = int(ok[ok["items_per_compute_s"] >= 0.9 * best]["batch_size"].min())
    return Flag("diminishing_returns", "info",
                f"Batches above ~{knee} add little throughput",
                {"batch_size_large": int(hi["batch_size"]), "batch_size_half": int(lo["batch_size"]),
                 "items_per_s_large": round(float(hi["items_per_compute_s"]), 1),
                 "items_per_s_half": round(float(lo["items_per_compute_s"]), 1),
                 "gain": round(gain, 3), "knee_batch_size": knee},
                [f"Set max_batch_size near {knee}: larger batches cost latency and memory without "
                 "raising items per second.",
                 "Use preferred_batch_sizes to cut partial batches at sizes the device runs "
                 "efficiently."], "batch_efficiency")


def rule_low_utilization(bundle: dict, th: Thresholds) -> Flag | None:
    h = _head(bundle)
    util = _num(h.get("utilization_mean_pct"), math.nan)
    depth = _num(h.get("queue_depth_mean"))
    if not _enough(h, th) or math.isnan(util) or util >= th.low_utilization_pct \
            or depth < th.low_utilization_queue_depth:
        return None
    return Flag("low_utilization", "warning",
                f"Device only {util:.0f}% busy while {depth:.1f} requests wait on average",
                {"utilization_mean_pct": round(util, 1), "queue_depth_mean": round(depth, 2),
                 "mean_batch_size": round(_num(h.get("mean_batch_size")), 2),
                 "max_batch_size": int(_num(h.get("max_batch_size")))},
                ["Work is queued but the device idles: the time goes to the host side (decode, "
                 "collate, copies) or to waiting. Raise max_batch_size or lower "
                 "max_queue_delay_ms so queued work is dispatched.",
                 "Profile decode/collate; move tensor preparation off the critical path.",
                 "Check the static policy's static_max_wait_ms: it holds partial batches."],
                "device")


def rule_starvation(bundle: dict, th: Thresholds) -> Flag | None:
    pr = bundle.get("priority")
    if pr is not None and len(pr) >= 2:
        pr = pr.assign(expired_fraction=pr["expired"] / pr["requests"].clip(lower=1))
        best = pr.sort_values("priority").iloc[0]
        for _, lvl in pr.iloc[1:].iterrows():
            exp_bad = (lvl["expired_fraction"] >= th.starvation_expired_fraction
                       and best["expired_fraction"] < th.starvation_expired_fraction / 5)
            w, wb = _num(lvl["queue_wait_mean_s"]), _num(best["queue_wait_mean_s"])
            wait_bad = w >= th.starvation_min_wait_s and w >= th.starvation_wait_ratio * max(wb, 1e-6)
            if exp_bad or wait_bad:
                return Flag("starvation", "warning",
                            f"Priority {int(lvl['priority'])} (HTTP {int(lvl['priority']) + 1}) is starved",
                            {"priority": int(lvl["priority"]),
                             "expired_fraction": round(float(lvl["expired_fraction"]), 3),
                             "queue_wait_mean_ms": _ms(w), "priority_0_queue_wait_mean_ms": _ms(wb),
                             "priority_0_expired_fraction": round(float(best["expired_fraction"]), 3)},
                            ["Higher priorities take every batch slot; lower-priority requests "
                             "wait until they expire. Add capacity or raise max_batch_size so "
                             "batches have room for them.",
                             "Send less traffic at the urgent levels, or give low priority a "
                             "longer timeout so it can wait out bursts."], "priority")
    share = bundle.get("model_share")
    if share is not None and len(share) >= 2:
        waits = share.set_index("model")["queue_wait_mean_s"].astype(float)
        worst = waits.idxmax()
        others = waits.drop(worst)
        if waits[worst] >= th.starvation_min_wait_s and \
                waits[worst] >= th.starvation_wait_ratio * max(float(others.min()), 1e-6):
            return Flag("starvation", "warning", f"Model {worst} is starved of device time",
                        {"model": worst, "queue_wait_mean_ms": _ms(float(waits[worst])),
                         "other_models_wait_min_ms": _ms(float(others.min())),
                         "device_share": round(float(share.set_index("model")["share"][worst]), 3)},
                        ["Other models on the same device take its turns: give it its own "
                         "device, or lower the others' max_batch_size so turns are shorter."],
                        "model_share")
    return None


RULES: dict[str, Callable[[dict, Thresholds], Flag | None]] = {
    "oom": rule_oom,
    "repeated_oom": rule_repeated_oom,
    "tail_latency": rule_tail_latency,
    "batches_not_forming": rule_batches_not_forming,  # or batches_capped, when requests queue
    "queue_wait_low_load": rule_queue_wait_low_load,
    "saturation": rule_saturation,
    "padding_waste": rule_padding_waste,
    "diminishing_returns": rule_diminishing_returns,
    "low_utilization": rule_low_utilization,
    "preemption_thrash": rule_preemption_thrash,
    "speculation_not_paying": rule_speculation_not_paying,
    "long_prefill_stall": rule_long_prefill_stall,
    "starvation": rule_starvation,
    "adapter_thrash": rule_adapter_thrash,
    "adapter_starving": rule_adapter_starving,
    "adapter_mixing_off": rule_adapter_mixing_off,
}


def diagnose(bundle: dict, thresholds: Thresholds | None = None) -> list[Flag]:
    """Run every rule over one window's bundle; most severe first."""
    th = thresholds or Thresholds()
    flags = [f for rule in RULES.values() if (f := rule(bundle, th)) is not None]
    return sorted(flags, key=lambda f: SEVERITY_ORDER.get(f.severity, 9))
