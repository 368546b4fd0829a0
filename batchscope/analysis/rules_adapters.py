"""Diagnosis rules of models with LoRA adapters: adapters thrashing the device's slots,
an adapter starved behind the others, and mixing turned off where it would pay. Pure
functions over a window's bundle, as the other rules (``batchscope.analysis.diagnosis``)."""

from __future__ import annotations

import math

import pandas as pd

from batchscope.analysis.flags import Flag, Thresholds, _ms, _num


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
