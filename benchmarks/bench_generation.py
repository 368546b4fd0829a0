"""Continuous vs static batching for generation, same model and same KV-cache memory.

A seeded mixed-length workload (prompt and output lengths drawn uniformly from wide
ranges; ``ignore_eos`` so every request generates exactly its drawn length) runs
through the bundled paged decoder twice per repeat, once per mode, interleaved so
that a noisy machine hurts both alike. Everything is the same between the modes but
the scheduling: ``continuous`` lets requests join at the next step and leave as soon
as they end; ``static`` admits a batch (reserving each member's whole length, which
is what a non-paged static batch does) and admits nobody until all of it ended; like
one padded batch tensor, a member that finished early still has its row computed
(``pad_rows``) until the longest member finishes, though its result goes out at once.

The step loop runs in this process without HTTP (the runtime's own ``StepRunner``),
on the real clock, torch on one thread. Reported: output tokens/s over the makespan
(first arrival to last completion) and per CPU second of this process, latency and time-to-first-token percentiles, the
mean number of sequences per step, and the continuous/static ratios of that run.

    python -m benchmarks.bench_generation                      # 160 requests, all at once
    python -m benchmarks.bench_generation --arrival poisson --rate 40 --requests 200
    python -m benchmarks.bench_generation --quick --json       # a small run, JSON out
    python -m benchmarks.bench_generation --speculation        # speculative decoding

``--speculation`` compares decoding without speculation, with prompt lookup (ngram)
and with the bundled draft model on the same requests, in the same run: at batch 1
(one request at a time; prompt lookup on repetitive prompts, whose continuation
recurs in them), and at a large batch with the automatic off-switch on. The target is
``runtime.generation.draft.patterned_target`` (the decoder's size, trained on the
patterns the draft was trained on, so acceptance is real); greedy, so every variant
generates the same tokens, which is checked.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from batchscope.storage.records import GenStepRow, ListRecorder, RequestRow
from benchmarks.common import format_table, set_torch_threads
from runtime.core.clock import MonotonicClock
from runtime.generation.config import GenerationConfig
from runtime.generation.runner import StepRunner
from runtime.models.decoder import TinyDecoder


@dataclass(frozen=True)
class Job:
    arrival_s: float
    prompt_ids: list[int]
    max_new_tokens: int


def make_workload(count: int, *, seed: int = 0, prompt_range: tuple[int, int] = (4, 256),
                  output_range: tuple[int, int] = (4, 256), arrival: str = "burst",
                  rate_per_s: float = 40.0) -> list[Job]:
    """``count`` jobs; ``burst`` arrives all at t=0, ``poisson`` at exponential gaps."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for _ in range(count):
        if arrival == "poisson":
            t += rng.expovariate(rate_per_s)
        n_prompt = rng.randint(*prompt_range)
        jobs.append(Job(arrival_s=t, prompt_ids=[rng.randrange(256) for _ in range(n_prompt)],
                        max_new_tokens=rng.randint(*output_range)))
    return jobs


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def run_mode(model: TinyDecoder, config: GenerationConfig, jobs: list[Job], *,
             device: str = "cpu", draft_model: Any = None,
             outputs: list | None = None) -> dict[str, Any]:
    """Drive ``jobs`` through one ``StepRunner`` on the real clock; the mode's figures.
    ``outputs``: a list that receives each job's generated tokens, in job order."""
    clock = MonotonicClock()
    rec = ListRecorder()
    runner = StepRunner(model, config, recorder=rec, clock=clock, draft_model=draft_model)
    runner.setup(device)
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    seqs = []
    start, cpu_start = clock.now(), time.process_time()
    i = 0
    while i < len(pending) or runner.has_work():
        now = clock.now() - start
        while i < len(pending) and pending[i].arrival_s <= now:
            seqs.append(runner.new_sequence(pending[i].prompt_ids,
                                            max_new_tokens=pending[i].max_new_tokens,
                                            ignore_eos=True))
            i += 1
        if runner.has_work():
            runner.step()
        elif i < len(pending):
            time.sleep(max(0.0, pending[i].arrival_s - (clock.now() - start)))
    end, cpu_s = clock.now(), time.process_time() - cpu_start
    reqs = rec.of(RequestRow)
    steps = rec.of(GenStepRow)
    assert len(reqs) == len(jobs) and all(r.outcome == "ok" for r in reqs), "a request failed"
    out_tokens = sum(r.output_tokens for r in reqs)
    assert out_tokens == sum(j.max_new_tokens for j in jobs)
    latencies = [r.latency_s for r in reqs]
    ttfts = [r.ttft_s for r in reqs]
    if outputs is not None:
        outputs.extend(s.output_ids for s in seqs)
    spec = runner.stats()["speculation"]
    return {
        "acceptance_rate": spec["acceptance_rate"],
        "mean_acceptance_length": spec["mean_acceptance_length"],
        "mode": config.mode, "requests": len(reqs), "output_tokens": out_tokens,
        "makespan_s": end - start, "tokens_per_s": out_tokens / (end - start),
        # CPU time of this process: steadier than wall time when the machine is shared
        "cpu_s": cpu_s, "tokens_per_cpu_s": out_tokens / max(cpu_s, 1e-9),
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "mean_seqs_per_step": statistics.fmean(s.running for s in steps) if steps else 0.0,
        "steps": len(steps), "pad_rows": runner.padding_rows,
        "preemptions": runner.scheduler.total_preemptions,
    }


@dataclass(frozen=True)
class BenchSettings:
    requests: int = 160
    seed: int = 0
    arrival: str = "burst"
    rate_per_s: float = 40.0
    prompt_min: int = 4
    prompt_max: int = 256
    output_min: int = 4
    output_max: int = 256
    repeats: int = 2
    block_size: int = 16
    num_cache_blocks: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    n_layers: int = 3
    device: str = "cpu"


def run_benchmark(s: BenchSettings) -> dict[str, Any]:
    """Both modes on the same seeded workload, interleaved; the caller sets torch threads."""
    jobs = make_workload(s.requests, seed=s.seed, prompt_range=(s.prompt_min, s.prompt_max),
                         output_range=(s.output_min, s.output_max), arrival=s.arrival,
                         rate_per_s=s.rate_per_s)
    model = TinyDecoder(n_layers=s.n_layers, max_model_len=1024)
    base = GenerationConfig(block_size=s.block_size, num_cache_blocks=s.num_cache_blocks,
                            max_model_len=1024, max_num_seqs=s.max_num_seqs,
                            max_num_batched_tokens=s.max_num_batched_tokens,
                            max_queue_size=max(1024, s.requests))
    # warm up the kernels and allocator once, outside the measurement
    run_mode(model, base, make_workload(8, seed=s.seed + 1, output_range=(4, 16)), device=s.device)
    runs: list[dict[str, Any]] = []
    for rep in range(s.repeats):
        order = ("continuous", "static") if rep % 2 == 0 else ("static", "continuous")
        for mode in order:
            row = run_mode(model, base.with_changes({"mode": mode}), jobs, device=s.device)
            row["repeat"] = rep
            runs.append(row)

    def median_of(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    ratios = {
        "throughput_continuous_over_static":
            median_of("continuous", "tokens_per_s") / median_of("static", "tokens_per_s"),
        "throughput_per_cpu_s_continuous_over_static":
            median_of("continuous", "tokens_per_cpu_s") / median_of("static", "tokens_per_cpu_s"),
        "p99_latency_static_over_continuous":
            median_of("static", "latency_p99_s") / median_of("continuous", "latency_p99_s"),
        # device-independent: how many more steps static batching needs for the same work
        "steps_static_over_continuous":
            median_of("static", "steps") / median_of("continuous", "steps"),
        "p50_ttft_static_over_continuous":
            median_of("static", "ttft_p50_s") / max(1e-9, median_of("continuous", "ttft_p50_s")),
    }
    return {"settings": asdict(s), "kv_cache_tokens": base.cache_tokens,
            "kv_cache_bytes": s.num_cache_blocks * (model.kv_bytes_per_block() or 0),
            "runs": runs, "ratios": ratios}


# -- speculative decoding -------------------------------------------------------------------
def repetitive_prompts(count: int, *, seed: int = 0, length: int = 96) -> list[list[int]]:
    """Prompts in which the patterns' continuation recurs: a run of the successor table,
    then its first tokens again, so that what the target writes next is already there."""
    from runtime.generation.draft import successor_table

    succ, rng = successor_table(), random.Random(seed)
    out = []
    for _ in range(count):
        run = [rng.randrange(256)]
        while len(run) < length:
            run.append(succ[run[-1]])
        out.append(run + run[:rng.randint(4, 12)])
    return out


SPEC_COLUMNS = ("case", "method", "batch", "requests", "output_tokens", "makespan_s",
                "tokens_per_s", "tokens_per_cpu_s", "steps", "acceptance_rate",
                "mean_acceptance_length")


def run_speculation(*, requests_batch1: int = 8, requests_batched: int = 32,
                    output_tokens: int = 64, k: int = 4, seed: int = 0,
                    device: str = "cpu", train_steps: int = 300) -> dict[str, Any]:
    """Off / ngram / draft at batch 1 and at batch ``requests_batched`` (auto-switch on);
    ratios of output tokens/s to no speculation, all measured in this run."""
    from runtime.generation.draft import bundled_draft, patterned_target

    target = patterned_target(train_steps=train_steps)
    draft = bundled_draft(train_steps=train_steps)
    rng = random.Random(seed)
    plain_prompts = [[rng.randrange(256) for _ in range(rng.randint(8, 64))]
                     for _ in range(max(requests_batch1, requests_batched))]
    cases = [
        # (case, prompts, max_num_seqs, auto-switch, methods)
        ("batch 1", plain_prompts[:requests_batch1], 1, False, ("none", "draft")),
        ("batch 1, repetitive prompts", repetitive_prompts(requests_batch1, seed=seed), 1,
         False, ("none", "ngram")),
        (f"batch {requests_batched}, auto-switch", plain_prompts[:requests_batched],
         requests_batched, True, ("none", "ngram", "draft")),
    ]
    base = GenerationConfig(max_model_len=1024, num_cache_blocks=1024,
                            max_num_batched_tokens=max(512, 64 * (k + 1)),
                            num_speculative_tokens=k, max_queue_size=1024)
    rows, ratios = [], {}
    for case, prompts, seqs, auto, methods in cases:
        jobs = [Job(0.0, p, output_tokens) for p in prompts]
        reference: list = []
        plain: dict[str, Any] = {}
        for method in methods:
            config = base.with_changes({"max_num_seqs": seqs, "speculative_method": method,
                                        "spec_auto_switch": auto})
            # each configuration's first steps of a new shape (a verification's width, the
            # draft model's own kernels) pay one-time costs: warm them up outside the measure
            run_mode(target, config, [Job(0.0, p, 8) for p in prompts], device=device,
                     draft_model=draft)
            outs: list = []
            row = run_mode(target, config, jobs, device=device, draft_model=draft, outputs=outs)
            if method == "none":
                reference, plain = outs, row
            assert outs == reference, f"{case}: {method} changed the greedy output"
            row.update(case=case, method=method, batch=seqs)
            rows.append(row)
            if method != "none":
                ratios[f"{case}: {method} / none"] = row["tokens_per_s"] / plain["tokens_per_s"]
    return {"rows": rows, "ratios": ratios, "num_speculative_tokens": k}


COLUMNS = ("repeat", "mode", "requests", "output_tokens", "makespan_s", "tokens_per_s",
           "tokens_per_cpu_s",
           "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "mean_seqs_per_step",
           "steps", "pad_rows", "preemptions")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=BenchSettings.requests)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arrival", choices=("burst", "poisson"), default="burst")
    p.add_argument("--rate", type=float, default=BenchSettings.rate_per_s,
                   help="requests per second with --arrival poisson")
    p.add_argument("--prompt", default="4:256", help="prompt length range MIN:MAX")
    p.add_argument("--output", default="4:256", help="output length range MIN:MAX")
    p.add_argument("--repeats", type=int, default=BenchSettings.repeats)
    p.add_argument("--num-cache-blocks", type=int, default=BenchSettings.num_cache_blocks)
    p.add_argument("--block-size", type=int, default=BenchSettings.block_size)
    p.add_argument("--max-num-seqs", type=int, default=BenchSettings.max_num_seqs)
    p.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    p.add_argument("--quick", action="store_true", help="40 requests, outputs 4..64, one repeat")
    p.add_argument("--speculation", action="store_true",
                   help="compare no speculation, prompt lookup and the draft model instead")
    p.add_argument("--spec-output", type=int, default=64,
                   help="--speculation: tokens generated per request")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    pmin, pmax = (int(x) for x in a.prompt.split(":"))
    omin, omax = (int(x) for x in a.output.split(":"))
    s = BenchSettings(requests=a.requests, seed=a.seed, arrival=a.arrival, rate_per_s=a.rate,
                      prompt_min=pmin, prompt_max=pmax, output_min=omin, output_max=omax,
                      repeats=a.repeats, block_size=a.block_size,
                      num_cache_blocks=a.num_cache_blocks, max_num_seqs=a.max_num_seqs,
                      device=a.device)
    if a.quick:
        s = BenchSettings(**{**asdict(s), "requests": 40, "output_max": 64, "repeats": 1})
    set_torch_threads(1)
    if a.speculation:
        return _print_speculation(run_speculation(output_tokens=a.spec_output, seed=a.seed,
                                                  device=a.device, requests_batch1=4 if a.quick
                                                  else 8, requests_batched=16 if a.quick
                                                  else 32), a.json)
    result = run_benchmark(s)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"workload: {s.requests} requests, prompts {s.prompt_min}..{s.prompt_max}, outputs "
          f"{s.output_min}..{s.output_max} tokens, arrival {s.arrival}"
          + (f" at {s.rate_per_s}/s" if s.arrival == "poisson" else "")
          + f"; KV cache {result['kv_cache_tokens']} tokens "
          f"({result['kv_cache_bytes'] / 2**20:.1f} MiB) for both modes, max_num_seqs "
          f"{s.max_num_seqs}, device {s.device}, torch on 1 thread")
    print(format_table(result["runs"], COLUMNS))
    r = result["ratios"]
    print(f"\ncontinuous / static output tokens/s: {r['throughput_continuous_over_static']:.2f}x")
    print(f"  same, per CPU second:              "
          f"{r['throughput_per_cpu_s_continuous_over_static']:.2f}x")
    print(f"static / continuous p99 latency:     {r['p99_latency_static_over_continuous']:.2f}x")
    print(f"static / continuous p50 TTFT:        {r['p50_ttft_static_over_continuous']:.2f}x")
    print(f"static / continuous steps:           {r['steps_static_over_continuous']:.2f}x  "
          "(the throughput ratio where a step costs the same whatever its batch size)")
    print("(medians over repeats, both modes measured in this run; a shared machine adds noise)")
    return 0


def _print_speculation(result: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"speculative decoding, greedy, num_speculative_tokens={result['num_speculative_tokens']}"
          ", torch on 1 thread; every variant generated the same tokens")
    print(format_table(result["rows"], SPEC_COLUMNS))
    for name, ratio in result["ratios"].items():
        print(f"{name} output tokens/s: {ratio:.2f}x")
    print("(measured in this run; a shared machine adds noise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
