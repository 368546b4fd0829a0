"""Diagnosis rules of generation models: preemption thrash (a KV cache too small for the
running sequences), speculative decoding that does not pay for itself, and long prompts'
prefill stalling the decodes of the running sequences. Pure functions over a window's
bundle, as the other rules (``batchscope.analysis.diagnosis``)."""

from __future__ import annotations

import math

import pandas as pd

from batchscope.analysis.flags import Flag, Thresholds, _ms, _num


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
