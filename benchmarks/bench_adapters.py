"""Mixed-adapter batching of the ``encoder`` or the ``wide`` model: one command, every
ratio measured in one run.

    python -m benchmarks.bench_adapters                  # the encoder, about a minute
    python -m benchmarks.bench_adapters --model wide     # the weight-bound MLP
    python -m benchmarks.bench_adapters --duration-s 1 --clients 16 --json

Scenarios, each N closed-loop clients on the request engine in this process (the device
thread, no HTTP, so the figures are the batching's and the model's); encoder requests
have lengths 8..64, ``wide`` requests one vector of 256:

* ``base``: no adapters;
* ``mixed``: 8 adapters, even traffic, ``adapter_mixing`` on;
* ``per_adapter``: the same traffic with ``adapter_mixing`` off (a batch holds one
  adapter's requests: how per-model batching serves a fleet of fine-tunes);
* ``one_adapter``: every request for one adapter, and ``merged``: that adapter merged
  into the base weights, served as the base.

Every scenario batches with ``max_batch_size`` = 64 (``--max-batch-size``): one batch
may hold a request of every client, where batching per adapter reaches 8 (the clients of
one adapter). Ratios: mixed / per_adapter (target >= 2), mixed / base (>= 0.8),
one_adapter / merged (>= 0.75, i.e. at most 25 % slower), each scenario's mean batch
size, and the ceiling of the first: the base model alone (no server) in batches of the
mixed run's size against the per-adapter run's, what mixing can gain on this machine. ``skewed``: 32 adapters on 8 slots, Zipf traffic: the
p99 latency of the cold adapters (ranked below the slot count) over the hot ones' (the top
4), target <= 2. Also: the three formulations of the batched LoRA
term (``runtime.adapters.lora``) on one batch, and the slot cache driven by a scripted
Zipf sequence over 64 adapters and 8 slots, its evictions against an LRU model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time

import numpy as np
import torch

from benchmarks.bench_offline import offline_throughput
from runtime.adapters.demo import write_demo_adapters
from runtime.adapters.lora import (AdapterRef, lora_term, read_peft, segment_term,
                                   stacked_term)
from runtime.adapters.slots import SlotCache
from runtime.api.config import BatchingConfig
from runtime.api.model import ModelAPI
from runtime.engine.engine import Engine
from runtime.models.encoder import EncoderModel
from runtime.models.wide import WideModel

MODELS: dict[str, type[ModelAPI]] = {"encoder": EncoderModel, "wide": WideModel}
#: the skewed scenario: adapters, slots and the Zipf exponent of their traffic
SKEWED_ADAPTERS = 32
SKEWED_SLOTS = 8
ZIPF_S = 1.1


def merged(base: type[ModelAPI], adapter_path: str) -> type[ModelAPI]:
    """``base`` with the adapter at ``adapter_path`` merged into its weights (W + scale * B A)."""

    class Merged(base):  # type: ignore[misc, valid-type]
        def setup(self, device) -> None:
            super().setup(device)
            adapter = read_peft(adapter_path, self.adapter_targets, "merged")
            modules = dict(self.net.named_modules())
            with torch.no_grad():
                for module, pair in adapter.pairs.items():
                    modules[module].weight += pair.scale * (pair.b @ pair.a)

    return Merged


def request_pool(model: str, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """256 requests' inputs: token ids of 8..64 tokens for the encoder, a vector for wide."""
    rng = np.random.default_rng(seed)
    if model == "encoder":
        return [{"INPUT_IDS": rng.integers(1, 1000, int(n)).astype(np.int64)}
                for n in rng.integers(8, 65, 256)]
    return [{"INPUT0": rng.standard_normal(256).astype(np.float32)} for _ in range(256)]


async def closed_loop(engine: Engine, model: str, clients: int, duration_s: float,
                      adapters: list[str | None], seed: int = 0) -> float:
    """Requests per second of ``clients`` closed loops, each request's adapter drawn
    evenly from ``adapters``."""
    pool = request_pool(model, seed)
    done = 0
    stop = time.perf_counter() + duration_s

    async def client(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < stop:
            adapter = adapters[i % len(adapters)]
            extra = {} if adapter is None else {"adapter": adapter}
            await engine.infer(model, pool[i % len(pool)], **extra)
            done += 1
            i += clients

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return done / (time.perf_counter() - started)


async def scenario(model: ModelAPI, config: BatchingConfig, paths: dict[str, str],
                   clients: int, duration_s: float, adapters: list[str | None]
                   ) -> tuple[float, float]:
    """Requests per second, and the mean batch size, of the measured window."""
    name = model.name
    engine = Engine({name: model}, {name: config}, inline_max_compute_ms=0)
    for adapter, path in paths.items():
        engine.register_adapter(name, adapter, path)
    await engine.start()
    try:
        await closed_loop(engine, name, clients, min(1.0, duration_s / 2), adapters)  # warm up
        before = engine.stats(name)
        rate = await closed_loop(engine, name, clients, duration_s, adapters)
        after = engine.stats(name)
        batches = max(1, after["batches"] - before["batches"])
        return rate, (after["requests"] - before["requests"]) / batches
    finally:
        await engine.stop()


def ceiling(model: ModelAPI, big: float, small: float, duration_s: float = 1.5) -> dict:
    """The base model alone (no server, no adapters), in batches of the mixed run's mean
    size against batches of the per-adapter run's (of requests of like lengths, as length
    buckets make them): how much more a batch of the one serves on this machine, so
    about the most mixing can gain here over batching per adapter."""
    model.setup("cpu")
    pool = request_pool(model.name)
    order = "sorted" if model.variable_length else "random"  # served batches are bucketed
    rates = {n: offline_throughput(model, pool, n, order=order, duration_s=duration_s).items_per_s
             for n in sorted({max(1, round(big)), max(1, round(small))})}
    return {"mixed_batch": big, "per_adapter_batch": small,
            "ratio": rates[max(1, round(big))] / rates[max(1, round(small))]}


async def skewed(model: ModelAPI, config: BatchingConfig, paths: dict[str, str], clients: int,
                 duration_s: float, seed: int = 0) -> dict:
    """Zipf traffic over every adapter in ``paths`` (more adapters than ``adapter_slots``):
    each request's latency by adapter, and the slot cache's loads and evictions. The
    adapters ranked below the slot count are the cold ones: most of their requests find
    them evicted and wait for a slot."""
    names = list(paths)
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(len(names))]
    name = model.name
    engine = Engine({name: model}, {name: config}, inline_max_compute_ms=0)
    for adapter, path in paths.items():
        engine.register_adapter(name, adapter, path)
    await engine.start()
    pool = request_pool(name, seed)
    latencies: dict[str, list[float]] = {n: [] for n in names}
    try:
        for phase, seconds in (("warm", min(1.0, duration_s / 2)), ("measure", duration_s)):
            stop = time.perf_counter() + seconds
            rng = random.Random(seed)

            async def client(k: int) -> None:
                i = k
                while time.perf_counter() < stop:
                    adapter = rng.choices(names, weights)[0]
                    started = time.perf_counter()
                    await engine.infer(name, pool[i % len(pool)], adapter=adapter)
                    if phase == "measure":
                        latencies[adapter].append(time.perf_counter() - started)
                    i += clients

            await asyncio.gather(*(client(k) for k in range(clients)))
        stats = engine.stats(name)["adapters"]
    finally:
        await engine.stop()
    slots = config.adapter_slots
    hot = [t for n in names[:slots // 2] for t in latencies[n]]
    cold = [t for n in names[slots:] for t in latencies[n]]
    p99 = lambda xs: float(np.percentile(xs, 99)) * 1000.0  # noqa: E731
    return {"adapters": len(names), "slots": slots, "hot_requests": len(hot),
            "cold_requests": len(cold), "hot_p99_ms": p99(hot), "cold_p99_ms": p99(cold),
            "cold_over_hot_p99": p99(cold) / p99(hot),
            "slot_misses": stats["slot_misses"], "slot_evictions": stats["slot_evictions"]}


def formulations(repeat: int = 10) -> dict[str, float]:
    """ms per call of each formulation of the term on one encoder-sized batch:
    32 rows x 64 tokens, 256 -> 1024, rank 8, 8 adapters."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, 256, generator=gen)
    a = torch.randn(9, 8, 256, generator=gen)
    b = torch.randn(9, 1024, 8, generator=gen)
    rows = torch.arange(32) % 8
    out = {}
    with torch.inference_mode():
        for name, fn in (("gather_bmm", lora_term), ("segment_loop", segment_term),
                         ("stacked_mask", stacked_term)):
            fn(x, a, b, rows)
            started = time.perf_counter()
            for _ in range(repeat):
                fn(x, a, b, rows)
            out[name] = (time.perf_counter() - started) / repeat * 1000.0
    return out


def lru_check(adapters: int = 64, slots: int = 8, steps: int = 5000, seed: int = 1) -> dict:
    """The slot cache under a Zipf sequence, against an LRU model of the same sequence."""
    rng = random.Random(seed)
    names = [f"a{k}" for k in range(adapters)]
    sequence = rng.choices(names, [1.0 / (k + 1) for k in range(adapters)], k=steps)
    cache = SlotCache(slots)
    lru: list[str] = []
    mismatches = predicted = 0
    for t, name in enumerate(sequence):
        expected = None
        if name in lru:
            lru.remove(name)
        elif len(lru) == slots:
            expected = lru.pop(0)
            predicted += 1
        lru.append(name)
        slot, change = cache.acquire(AdapterRef(name, "", 1), float(t))
        cache.release([slot])
        if (change.evicted if change else None) != expected:
            mismatches += 1
    return {"requests": steps, "evictions": cache.evictions, "predicted": predicted,
            "mismatches": mismatches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="encoder",
                   help="the base model the adapters are of (default: encoder)")
    p.add_argument("--duration-s", type=float, default=6.0, help="seconds per scenario")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="the batching setting of every scenario (default: 64, so one batch "
                        "may hold a request of every client)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = BatchingConfig(max_batch_size=args.max_batch_size)
    model = MODELS[args.model]
    with tempfile.TemporaryDirectory() as root:
        paths = write_demo_adapters(root, 8, args.model)
        names = list(paths)

        def run(model, cfg, registered, adapters):
            return asyncio.run(scenario(model, cfg, registered, args.clients, args.duration_s,
                                        adapters))

        runs = {
            "base": run(model(), config, {}, [None]),
            "mixed": run(model(), config, paths, names),
            "per_adapter": run(model(), config.with_changes({"adapter_mixing": False}),
                               paths, names),
            "one_adapter": run(model(), config, {names[0]: paths[names[0]]}, [names[0]]),
            "merged": run(merged(model, paths[names[0]])(), config, {}, [None]),
        }
        rates = {k: rate for k, (rate, _) in runs.items()}
        bound = ceiling(model(), runs["mixed"][1], runs["per_adapter"][1])
        many = write_demo_adapters(root, SKEWED_ADAPTERS, args.model)
        skew = asyncio.run(skewed(model(), config.with_changes(
            {"adapter_slots": SKEWED_SLOTS}), many, args.clients, args.duration_s))
    ratios = {"mixed/per_adapter": rates["mixed"] / rates["per_adapter"],
              "mixed/base": rates["mixed"] / rates["base"],
              "one_adapter/merged": rates["one_adapter"] / rates["merged"]}
    result = {"model": args.model, "requests_per_s": rates,
              "mean_batch": {k: size for k, (_, size) in runs.items()}, "ratios": ratios,
              "ceiling": bound, "term_ms": formulations(), "lru": lru_check(), "skewed": skew}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model {args.model}, {args.clients} clients, {args.duration_s:g} s per scenario")
    print(f"{'scenario':<14}{'requests/s':>12}{'mean batch':>12}")
    for name, rate in rates.items():
        print(f"{name:<14}{rate:>12.1f}{result['mean_batch'][name]:>12.1f}")
    targets = {"mixed/per_adapter": 2.0, "mixed/base": 0.8, "one_adapter/merged": 0.75}
    for name, ratio in ratios.items():
        print(f"{name:<20}{ratio:>7.2f}  (target >= {targets[name]})")
    print(f"ceiling: the base model alone serves {bound['ratio']:.2f}x as much in batches of "
          f"{bound['mixed_batch']:.1f} (mixed) as of {bound['per_adapter_batch']:.1f} (per "
          f"adapter); mixed/per_adapter reaches "
          f"{ratios['mixed/per_adapter'] / bound['ratio']:.0%} of it")
    print("LoRA term, ms per call: " + ", ".join(f"{k} {v:.2f}" for k, v in result["term_ms"].items()))
    print(f"skewed: {skew['adapters']} adapters, {skew['slots']} slots, Zipf {ZIPF_S}: p99 "
          f"cold {skew['cold_p99_ms']:.1f} ms / hot {skew['hot_p99_ms']:.1f} ms = "
          f"{skew['cold_over_hot_p99']:.2f} (target <= 2; {skew['cold_requests']} cold and "
          f"{skew['hot_requests']} hot requests, {skew['slot_evictions']} evictions)")
    lru = result["lru"]
    print(f"slot cache, 64 adapters / 8 slots, Zipf: {lru['evictions']} evictions, LRU predicts "
          f"{lru['predicted']}, {lru['mismatches']} mismatches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
