"""Diagnosis rules: pure functions over query results -> ``Flag``.

Each rule reads the bundle of ``queries.live_bundle`` for one window and either
returns ``None`` or a ``Flag`` naming the problem, how serious it is, the
numbers that show it, the chart to look at and concrete steps to take.
Thresholds live in ``Thresholds`` so they can be tuned and tested.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import pandas as pd

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
OOM_KINDS = ("oom", "oom_failed")


@dataclass(frozen=True)
class Flag:
    rule: str
    severity: str  # critical | warning | info
    title: str
    evidence: dict
    steps: list[str] = field(default_factory=list)
    chart: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Thresholds:
    min_batches: int = 20
    memory_near_fraction: float = 0.90
    repeated_oom_count: int = 3
    tail_ratio: float = 4.0
    tail_min_p99_s: float = 0.005
    not_forming_mean_size: float = 1.5
    not_forming_min_max_size: int = 4
    wait_over_compute: float = 2.0
    low_load_utilization_pct: float = 40.0
    low_load_size_fraction: float = 0.25
    rejected_fraction: float = 0.01
    queue_growth_factor: float = 2.0
    padding_waste_fraction: float = 0.30
    diminishing_gain: float = 1.15
    diminishing_min_batches_per_size: int = 5
    low_utilization_pct: float = 30.0
    low_utilization_queue_depth: float = 1.0
    preemptions_per_step: float = 0.10
    preemptions_per_sequence: float = 0.5
    starvation_expired_fraction: float = 0.10
    starvation_wait_ratio: float = 10.0
    starvation_min_wait_s: float = 0.100
    #: speculation_not_paying: judged at the current batch size once it has this many
    #: speculating steps, while this share of the window's last quarter speculates
    spec_min_steps: int = 20
    spec_on_fraction: float = 0.5
    #: ... when fewer of the proposed tokens are accepted (and speculation is not measured
    #: cheaper), or a generated token costs this much more with it than without, each
    #: way measured over this many steps without prefill
    spec_low_acceptance_rate: float = 0.3
    spec_cost_ratio: float = 1.05
    spec_min_compare_steps: int = 8
    #: long_prefill_stall: steps that decode and prefill at least this many tokens, this
    #: many of them, taking this many times a decode-only step; the suggested cap brings
    #: such a step to ``long_prefill_target_ratio`` times a decode-only one
    long_prefill_min_tokens: int = 256
    long_prefill_min_steps: int = 5
    long_prefill_stall_ratio: float = 4.0
    long_prefill_target_ratio: float = 2.0
    #: LoRA adapters: slot evictions per minute (and at least this many) that are thrash
    adapter_thrash_evictions_per_min: float = 10.0
    adapter_thrash_min_evictions: int = 10
    #: an adapter is starving when its p99 is this many times the other adapters' median
    #: p99, or this fraction of its requests expired (with this many requests at least)
    adapter_starving_p99_ratio: float = 4.0
    adapter_starving_expired_fraction: float = 0.10
    adapter_min_requests: int = 20
    #: mixing off while at least this many adapters have traffic
    adapter_spread_min_adapters: int = 4


def _num(value, default: float = 0.0) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(out) else out


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 2)


def _head(bundle: dict) -> dict:
    head = bundle.get("headline")
    return head.iloc[0].to_dict() if head is not None and len(head) else {}


def _enough(h: dict, th: Thresholds) -> bool:
    return _num(h.get("batches")) >= th.min_batches


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
        try:
            details = json.loads(last.get("details_json") or "{}")
        except ValueError:
            details = {}
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
    h = _head(bundle)
    mean, mx = _num(h.get("mean_batch_size")), _num(h.get("max_batch_size"))
    if not _enough(h, th) or mx < th.not_forming_min_max_size or mean > th.not_forming_mean_size:
        return None
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


def rule_queue_wait_low_load(bundle: dict, th: Thresholds) -> Flag | None:
    h = _head(bundle)
    if not _enough(h, th):
        return None
    wait, comp = _num(h.get("queue_wait_mean_s")), _num(h.get("compute_mean_s"))
    util = _num(h.get("utilization_mean_pct"), 100.0)
    mean, mx = _num(h.get("mean_batch_size")), _num(h.get("max_batch_size"), 1.0)
    low_load = util < th.low_load_utilization_pct or mean <= th.low_load_size_fraction * mx
    if comp <= 0 or wait < th.wait_over_compute * comp or not low_load \
            or _num(h.get("rejected")) > 0:
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


def rule_preemption_thrash(bundle: dict, th: Thresholds) -> Flag | None:
    gen = bundle.get("generation")
    if gen is None or not len(gen):
        return None
    g = gen.iloc[0]
    steps, pre, seqs = _num(g.get("steps")), _num(g.get("preemptions")), _num(g.get("sequences"))
    per_step = pre / steps if steps else 0.0
    per_seq = pre / seqs if seqs else 0.0
    if per_step < th.preemptions_per_step and per_seq < th.preemptions_per_sequence:
        return None
    return Flag("preemption_thrash", "warning",
                f"Preemption thrash: {int(pre)} preemptions in {int(steps)} steps",
                {"preemptions": int(pre), "steps": int(steps), "per_step": round(per_step, 3),
                 "per_sequence": round(per_seq, 3)},
                ["The KV cache is too small for the running sequences: admit fewer sequences "
                 "at once (lower the maximum running sequences) so admitted ones finish.",
                 "Give the cache more blocks (more memory for the KV cache, smaller block size).",
                 "Cap max new tokens per request to bound how much cache a sequence can claim."],
                "generation")


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


def _batch_sizes(top: int) -> str:
    """The batch sizes of a bucket of the speculation switch: 1, 2, 3-4, 5-8, ..."""
    return str(top) if top <= 2 else f"{top // 2 + 1}-{top}"


def _cost_per_token(row: pd.Series | None, th: Thresholds) -> float | None:
    """Step time per generated token over a ``generation_spec`` row's steps without
    prefill, or None when fewer than ``spec_min_compare_steps`` measured it."""
    if row is None or _num(row["decode_steps"]) < th.spec_min_compare_steps \
            or _num(row["decode_step_tokens"]) <= 0:
        return None
    return _num(row["decode_step_s"]) / _num(row["decode_step_tokens"])


def _spec_costs(spec: pd.DataFrame, th: Thresholds) -> dict[int, tuple[float | None, float | None]]:
    """Per batch-size bucket: the step time per generated token with and without speculation."""
    out = {}
    for top, rows in spec.groupby("batch_bucket"):
        by = {int(r["speculated"]): r for _, r in rows.iterrows()}
        out[int(top)] = (_cost_per_token(by.get(1), th), _cost_per_token(by.get(0), th))
    return out


def _speculation_steps(top: int, pays: list[int], dearer: bool, proposed: float,
                       accepted: float) -> list[str]:
    """What to do when speculation does not pay at batch-size bucket ``top``: ``pays``, the
    smaller buckets where it was measured cheaper; ``dearer``, measured dearer per token
    (else: low acceptance); ``proposed``/``accepted``: tokens per sequence and step."""
    if pays:
        limit = [f"Set speculative_disable_by_batch_size to {max(pays)}: speculation then stops "
                 f"above {max(pays)} running sequences, where it was measured cheaper per token."]
    elif top > 1:
        limit = [f"Set speculative_disable_by_batch_size to {top // 2}: speculation then stops "
                 f"above {top // 2} running sequences."]
    else:
        limit = ["Speculation does not pay even for one sequence: set speculative_method=none, "
                 "or try the other method."]
    fewer = max(1, math.ceil(accepted) + 1)
    tokens = [f"Lower num_speculative_tokens (to about {fewer}): of {proposed:.1f} tokens "
              f"proposed per sequence and step, {accepted:.1f} are accepted; every rejected one "
              "is computed for nothing."] if fewer < round(proposed) else []
    tokens += [
        "Switch method: ngram pays on output that repeats its prompt (code edits, extraction, "
        "answers quoting their context), a draft model of the target's family on free text. "
        "Requests that do not benefit can opt out with \"speculative\": false.",
        "Keep spec_auto_switch on: it measures each batch size with and without speculation "
        "and turns it off where it costs more (probing again every spec_probe_interval_steps); "
        "raise spec_min_acceptance_rate to turn it off sooner on low acceptance."]
    # dearer per token: the batch size first; low acceptance: the proposals first
    return limit + tokens if dearer else tokens + (limit if pays else [])


def rule_speculation_not_paying(bundle: dict, th: Thresholds) -> Flag | None:
    gen_t, spec = bundle.get("generation_t"), bundle.get("generation_spec")
    if gen_t is None or spec is None or not len(gen_t) or not len(spec):
        return None
    tail = gen_t.iloc[-max(1, math.ceil(len(gen_t) / 4)):]  # the window's last quarter
    with_proposer = _num(tail["spec_steps"].sum())
    on_share = _num(tail["speculating_steps"].sum()) / with_proposer if with_proposer else 0.0
    judged = spec[(spec["speculated"] == 1) & (spec["steps"] >= th.spec_min_steps)]
    if on_share < th.spec_on_fraction or not len(judged):
        return None
    batch = _num((tail["running"] * tail["steps"]).sum()) / max(1.0, _num(tail["steps"].sum()))
    now = 1 << max(0, math.ceil(batch) - 1).bit_length()  # the switch's bucket of it
    on = judged.iloc[(judged["batch_bucket"].map(math.log2) - math.log2(now)).abs().argmin()]
    top = int(on["batch_bucket"])
    costs = _spec_costs(spec, th)
    cost_on, cost_off = costs[top]
    # the sequences that had proposals verified (estimated for steps recorded without them)
    drafted, accepted, seqs = (_num(on["draft_tokens"]), _num(on["accepted_tokens"]),
                               max(1.0, _num(on.get("spec_sequences", on["sequences"]))))
    acceptance = accepted / drafted if drafted else 0.0
    measured = cost_on is not None and cost_off is not None
    dearer = measured and cost_on >= th.spec_cost_ratio * cost_off
    cheaper = measured and cost_on * th.spec_cost_ratio <= cost_off
    low = acceptance < th.spec_low_acceptance_rate
    if not dearer and not (low and not cheaper):
        return None
    sizes = _batch_sizes(top)
    why = (f"a generated token takes {_ms(cost_on)} ms of step time with it, {_ms(cost_off)} ms "
           "without" if dearer else
           f"only {acceptance:.0%} of the proposed tokens are accepted")
    pays = [t for t, (c_on, c_off) in costs.items() if t < top and c_on is not None
            and c_off is not None and c_on * th.spec_cost_ratio <= c_off]
    per_seq = drafted / seqs
    steps = _speculation_steps(top, pays, dearer, per_seq, accepted / seqs)
    return Flag("speculation_not_paying", "warning",
                f"Speculative decoding does not pay at batch sizes {sizes}: {why}",
                {"batch_size_now": round(batch, 1), "batch_sizes": sizes,
                 "speculating_share_now": round(on_share, 3),
                 "speculating_steps": int(_num(on["steps"])),
                 "acceptance_rate": round(acceptance, 3),
                 "tokens_per_verification": round(1.0 + accepted / seqs, 2),
                 "proposed_per_sequence": round(per_seq, 2),
                 "ms_per_token_with": None if cost_on is None else _ms(cost_on),
                 "ms_per_token_without": None if cost_off is None else _ms(cost_off)},
                steps, "generation")


def rule_long_prefill_stall(bundle: dict, th: Thresholds) -> Flag | None:
    pre = bundle.get("generation_prefill")
    if pre is None or not len(pre):
        return None
    decoding = pre[pre["decoding"] == 1]
    alone = decoding[decoding["prefill_from"] == 0]
    mixed = decoding[decoding["prefill_from"] > 0]
    long = mixed[mixed["prefill_from"] >= th.long_prefill_min_tokens]
    n_alone, n_long = _num(alone["steps"].sum()), _num(long["steps"].sum())
    if n_alone < th.long_prefill_min_steps or n_long < th.long_prefill_min_steps:
        return None
    alone_s = _num(alone["step_s_sum"].sum()) / n_alone
    long_s = _num(long["step_s_sum"].sum()) / n_long
    if alone_s <= 0 or long_s < th.long_prefill_stall_ratio * alone_s:
        return None
    # what a prefill token adds to a step that decodes, over every step that does both
    extra_s = _num(mixed["step_s_sum"].sum()) - _num(mixed["steps"].sum()) * alone_s
    per_token_s = max(0.0, extra_s) / max(1.0, _num(mixed["prefill_tokens"].sum()))
    cap = None
    if per_token_s > 0:
        cap = max(16, int((th.long_prefill_target_ratio - 1) * alone_s / per_token_s) // 16 * 16)
    decodes = _num(decoding["decodes"].sum()) / max(1.0, _num(decoding["steps"].sum()))
    ratio = long_s / alone_s
    target = th.long_prefill_target_ratio
    evidence = {"long_prefill_steps": int(n_long), "decode_only_steps": int(n_alone),
                "mean_prefill_tokens": round(_num(long["prefill_tokens"].sum()) / n_long, 1),
                "step_mean_ms_long_prefill": _ms(long_s),
                "step_max_ms_long_prefill": _ms(_num(long["step_max_s"].max())),
                "step_mean_ms_decode_only": _ms(alone_s), "ratio": round(ratio, 1),
                "decodes_stalled": int(_num(long["decodes"].sum())),
                "prefill_ms_per_1k_tokens": round(per_token_s * 1e6, 2),
                "suggested_long_prefill_token_threshold": cap}
    gen = bundle.get("generation")
    if gen is not None and len(gen) and pd.notna(gen.iloc[0].get("tpot_p99")):
        evidence.update(tpot_p50_ms=_ms(_num(gen.iloc[0]["tpot_p50"])),
                        tpot_p99_ms=_ms(_num(gen.iloc[0]["tpot_p99"])))
    size = f"about {cap}" if cap else "a fraction of the prompts' length"
    return Flag("long_prefill_stall", "warning",
                f"Long prefills stall the running decodes: steps with "
                f"{evidence['mean_prefill_tokens']:.0f} prefill tokens take {ratio:.1f}× a "
                "decode-only step",
                evidence,
                [f"Set long_prefill_token_threshold to {size}: a long prompt is then prefilled in "
                 f"slices of that many tokens over several steps, each about {target:g}× a "
                 f"decode-only step ({_ms(alone_s)} ms) instead of {ratio:.1f}×; the long "
                 "prompts' first token comes a few steps later.",
                 f"Or lower max_num_batched_tokens to {size} plus the {decodes:.0f} decodes a step "
                 "carries: it bounds every step's tokens, prefill chunks and decodes together "
                 "(it stays at least max_num_seqs).",
                 "Compare the time per output token p99 on the generation latency chart before "
                 "and after: a stall shows there, and a cap too small only adds steps."],
                "generation")


def rule_adapter_thrash(bundle: dict, th: Thresholds) -> Flag | None:
    """The slot cache evicts adapters faster than ``adapter_thrash_evictions_per_min``."""
    slots = bundle.get("adapter_slots")
    if slots is None or not len(slots):
        return None
    s = slots.iloc[0]
    evictions, per_min = int(_num(s.get("evictions"))), _num(s.get("evictions_per_min"))
    if evictions < th.adapter_thrash_min_evictions or per_min < th.adapter_thrash_evictions_per_min:
        return None
    hits, misses = int(_num(s.get("hits"))), int(_num(s.get("misses")))
    return Flag("adapter_thrash", "warning",
                f"Adapter thrash: {per_min:.1f} slot evictions per minute",
                {"evictions": evictions, "evictions_per_min": round(per_min, 2),
                 "slot_loads": misses, "slot_hits": hits,
                 "hit_rate": round(hits / max(1, hits + misses), 3)},
                ["More adapters take traffic than fit in the device slots, so batches keep "
                 "loading adapters the previous ones evicted: raise adapter_slots to the "
                 "number of adapters that take traffic (each slot costs the largest adapter's "
                 "memory).",
                 "If memory is short, lower max_adapters_per_batch so a batch pins fewer "
                 "slots, or send each adapter's traffic to fewer instances."],
                "adapters")


def rule_adapter_starving(bundle: dict, th: Thresholds) -> Flag | None:
    """One adapter's p99 far above the others', or its requests expiring."""
    ad = bundle.get("adapters")
    if ad is None or len(ad) < 2:
        return None
    ad = ad[ad["requests"].astype(float) >= th.adapter_min_requests]
    if len(ad) < 2:
        return None
    ad = ad.assign(expired_fraction=ad["expired"].astype(float) / ad["requests"].astype(float))
    p99 = ad.set_index("adapter")["latency_p99"].astype(float)
    for _, row in ad.sort_values("expired_fraction", ascending=False).iterrows():
        name = row["adapter"]
        others = p99.drop(name).dropna()
        if not len(others):
            continue
        typical = float(others.median())
        mine = float(p99.get(name)) if pd.notna(p99.get(name)) else math.nan
        other_expired = ad[ad["adapter"] != name]["expired_fraction"]
        expired_bad = (row["expired_fraction"] >= th.adapter_starving_expired_fraction
                       and float(other_expired.median()) < th.adapter_starving_expired_fraction / 5)
        slow_bad = (not math.isnan(mine) and typical > 0
                    and mine >= th.adapter_starving_p99_ratio * typical)
        if not (expired_bad or slow_bad):
            continue
        label = name or "(base model)"
        return Flag("adapter_starving", "warning", f"Adapter {label} is starving",
                    {"adapter": name, "requests": int(row["requests"]),
                     "expired_fraction": round(float(row["expired_fraction"]), 3),
                     "p99_ms": None if math.isnan(mine) else _ms(mine),
                     "others_median_p99_ms": _ms(typical)},
                    ["Its requests wait for a slot or a place in a batch while the others' "
                     "take them: with adapter_mixing off, turn it on so a batch takes every "
                     "adapter's requests.",
                     "Raise max_adapters_per_batch (up to adapter_slots) so a batch has room "
                     "for one more adapter, and adapter_slots if it keeps being evicted.",
                     "If it is a low-priority tenant by design, give its requests a longer "
                     "timeout."], "adapters")
    return None


def rule_adapter_mixing_off(bundle: dict, th: Thresholds) -> Flag | None:
    """Every batch held one adapter while the traffic spread over many."""
    mix, ad = bundle.get("adapter_mix"), bundle.get("adapters")
    if mix is None or ad is None or not len(mix) or not len(ad):
        return None
    batches = int(mix["batches"].sum())
    spread = int((ad[ad["adapter"] != ""]["requests"] > 0).sum())
    if batches < th.min_batches or spread < th.adapter_spread_min_adapters:
        return None
    if int(mix["adapters"].max()) > 1:
        return None
    mean_size = float(mix["requests"].sum()) / max(1, batches)
    return Flag("adapter_mixing_off", "warning",
                f"One adapter per batch while traffic spreads over {spread} adapters",
                {"adapters_with_traffic": spread, "batches": batches,
                 "max_adapters_in_a_batch": int(mix["adapters"].max()),
                 "mean_batch_size": round(mean_size, 2)},
                ["Batches are formed per adapter (adapter_mixing off), so each holds only "
                 "the requests of one adapter and stays small: turn adapter_mixing on so one "
                 "batch runs every adapter's requests together.",
                 f"Keep max_adapters_per_batch at {spread} or more (at most adapter_slots)."],
                "adapters")


RULES: dict[str, Callable[[dict, Thresholds], Flag | None]] = {
    "oom": rule_oom,
    "repeated_oom": rule_repeated_oom,
    "tail_latency": rule_tail_latency,
    "batches_not_forming": rule_batches_not_forming,
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
