"""Chunked prefill: a long prompt arriving while sequences decode, with and without chunks.

Eight sequences are decoding when one prompt of ``--long-prompt`` tokens (2,048 by
default) arrives. Without chunking (``max_num_batched_tokens`` large enough for the whole
prompt) one step computes all of it and every running sequence waits for that step; with
chunking (the default budget of 512 tokens a step, or ``long_prefill_token_threshold``)
the prompt is prefilled a slice a step beside the decodes. Printed, both measured in this
run on the same model: the p99 inter-token latency of the eight running sequences (their
gaps between tokens from the long prompt's arrival until its first token), the long
prompt's time to first token, and that every sequence's tokens are the same both ways.

    python -m benchmarks.bench_chunked_prefill
    python -m benchmarks.bench_chunked_prefill --long-prompt 1024 --json
    python -m benchmarks.bench_chunked_prefill --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any, Sequence

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from benchmarks.bench_generation import percentile
from benchmarks.common import set_torch_threads
from runtime.core.clock import MonotonicClock
from runtime.generation.config import GenerationConfig
from runtime.generation.runner import StepRunner
from runtime.models.decoder import TinyDecoder

RUNNING = 8
#: decode steps the eight sequences take before the long prompt arrives
LEAD_STEPS = 16


def run(config: GenerationConfig, long_prompt: list[int], prompts: list[list[int]],
        output_tokens: int, device: str = "cpu") -> dict[str, Any]:
    """Drive the scenario on the real clock; per-token times of every sequence."""
    model = TinyDecoder(max_model_len=config.max_model_len)
    clock = MonotonicClock()
    runner = StepRunner(model, config, clock=clock)
    runner.setup(device)
    running = [runner.new_sequence(p, max_new_tokens=output_tokens, ignore_eos=True) for p in prompts]
    times: dict[int, list[float]] = {id(s): [] for s in running}
    seen = {id(s): 0 for s in running}
    long_seq = None
    arrived = first_token = None
    steps = 0
    while runner.has_work():
        if steps == LEAD_STEPS:
            long_seq = runner.new_sequence(long_prompt, max_new_tokens=4, ignore_eos=True)
            arrived = clock.now()
        runner.step()
        steps += 1
        now = clock.now()
        for s in running:
            n = len(s.output_ids)
            times[id(s)].extend([now] * (n - seen[id(s)]))
            seen[id(s)] = n
        if long_seq is not None and first_token is None and long_seq.output_ids:
            first_token = now
    gaps = [b - a for s in running for a, b in zip(times[id(s)], times[id(s)][1:])
            if arrived is not None and first_token is not None and arrived <= b <= first_token + 1e-9]
    return {"itl_p99_s": percentile(gaps, 99), "itl_max_s": max(gaps) if gaps else float("nan"),
            "gaps": len(gaps), "ttft_long_s": (first_token or 0.0) - (arrived or 0.0),
            "outputs": [list(s.output_ids) for s in running] + [list(long_seq.output_ids)]}


def measure(long_prompt: int = 2048, budget: int = 512, output: int = 96,
            device: str = "cpu") -> dict[str, Any]:
    """Both ways on the same model and prompts (after a warm-up); the figures printed."""
    rng = random.Random(0)
    long_ids = [rng.randrange(256) for _ in range(long_prompt)]
    prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 64))] for _ in range(RUNNING)]
    max_len = long_prompt + 64
    blocks = (max_len + RUNNING * (64 + output)) // 16 + 64
    base = GenerationConfig(max_model_len=max_len, num_cache_blocks=blocks, max_num_seqs=RUNNING + 1)
    whole = base.with_changes({"max_num_batched_tokens": long_prompt + RUNNING})
    chunked = base.with_changes({"max_num_batched_tokens": budget})
    run(chunked, long_ids[:64], prompts, LEAD_STEPS + 8, device)  # warm up kernels and the allocator
    plain = run(whole, long_ids, prompts, output, device)
    sliced = run(chunked, long_ids, prompts, output, device)
    same = plain.pop("outputs") == sliced.pop("outputs")
    return {"long_prompt_tokens": long_prompt, "budget_tokens": budget, "device": device,
            "whole": plain, "chunked": sliced, "outputs_identical": same,
            "itl_p99_whole_over_chunked": plain["itl_p99_s"] / sliced["itl_p99_s"],
            "ttft_chunked_over_whole": sliced["ttft_long_s"] / plain["ttft_long_s"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long-prompt", type=int, default=2048, help="tokens of the arriving prompt")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens when chunking")
    p.add_argument("--output", type=int, default=96, help="tokens each running sequence generates")
    p.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    set_torch_threads(1)
    result = measure(a.long_prompt, a.budget, a.output, a.device)
    plain, sliced, same = result["whole"], result["chunked"], result["outputs_identical"]
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{RUNNING} sequences decoding, a {a.long_prompt}-token prompt arrives; device {a.device}, "
          "torch on 1 thread")
    for name, row in (("whole prompt in one step", plain), (f"chunks of {a.budget} tokens", sliced)):
        print(f"  {name:26s} running sequences' p99 inter-token latency {row['itl_p99_s'] * 1000:7.1f} ms"
              f" (max {row['itl_max_s'] * 1000:.1f} ms, {row['gaps']} gaps);"
              f" long prompt's TTFT {row['ttft_long_s'] * 1000:7.1f} ms")
    print(f"p99 inter-token latency, whole / chunked: {result['itl_p99_whole_over_chunked']:.2f}x")
    print(f"long prompt's TTFT, chunked / whole:     {result['ttft_chunked_over_whole']:.2f}x")
    print(f"outputs identical both ways: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
