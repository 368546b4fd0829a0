"""Demo runtime: the server plus synthetic traffic whose load keeps changing.

``python -m runtime.tools.demo --db URL --port 0`` serves ``mlp``, ``encoder`` (with the
8 demo LoRA adapters ``enc-0`` ... ``enc-7``, written into a temporary folder at start)
and the generation model ``decoder`` (``/v1/completions``) in-process, prints
``batchscope demo on <url> ...`` and then cycles through traffic phases (quiet,
busy, bursts with rejections, tight deadlines, urgent priorities, variable encoder
lengths, completions) until it is killed (``--cycles N``: N passes), so a dashboard shows
batches forming, queues building and draining, occasional 429s and expiries, and encoder
batches mixing adapters (half of most encoder flows' requests name one of the adapters).
Rates stay modest (``--intensity`` scales them) so the dashboard can run alongside
on a small machine. The traffic comes from a child process, as clients would, so that
generating it does not add to the latencies the server records.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from runtime.adapters.demo import cached_root, demo_name, write_demo_adapters
from runtime.api.config import BatchingConfig, ServerConfig

log = logging.getLogger("batchscope.demo")


@dataclass(frozen=True)
class Flow:
    """One stream of open-loop traffic during a phase."""

    model: str
    rate_rps: float
    lengths: str | None = None
    priority: str | None = None
    timeout_ms: float | None = None
    bypass: bool = False
    #: generation: completions with up to this many new tokens (0 = a KServe flow)
    max_tokens: int = 0
    #: the LoRA adapters the requests name, drawn evenly (None: the base model)
    adapters: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    flows: tuple[Flow, ...] = field(default_factory=tuple)


LENGTHS = "uniform:8:128"
MIX = "1=0.1,2=0.7,3=0.2"
#: the encoder's demo adapters, served from the start
ADAPTERS = tuple(demo_name(i) for i in range(8))
#: what an encoder flow's requests name: half the base model, half one of the adapters
SPREAD: tuple[str | None, ...] = (None,) * len(ADAPTERS) + ADAPTERS

PHASES: tuple[Phase, ...] = (
    Phase("quiet", 20, (Flow("mlp", 15, priority=MIX),
                        Flow("encoder", 3, LENGTHS, adapters=SPREAD),
                        Flow("decoder", 0.5, max_tokens=32))),
    Phase("busy", 30, (Flow("mlp", 250, priority=MIX),
                       Flow("encoder", 15, LENGTHS, MIX, adapters=SPREAD),
                       Flow("decoder", 2, max_tokens=64))),
    Phase("burst", 6, (Flow("mlp", 1500, priority=MIX),
                       Flow("encoder", 40, LENGTHS, adapters=SPREAD))),
    Phase("recovery", 15, (Flow("mlp", 60, priority=MIX),
                           Flow("encoder", 6, LENGTHS, adapters=SPREAD))),
    Phase("deadlines", 20, (Flow("mlp", 400, priority=MIX, timeout_ms=15),
                            Flow("encoder", 20, "choice:16,120", timeout_ms=150))),
    Phase("urgent", 15, (Flow("mlp", 150, priority="1"), Flow("mlp", 5, bypass=True),
                         Flow("encoder", 10, "uniform:8:32", "1=0.5,3=0.5", adapters=SPREAD))),
    Phase("long-inputs", 20, (Flow("mlp", 40),
                              Flow("encoder", 14, "uniform:96:128", adapters=SPREAD),
                              Flow("decoder", 1, max_tokens=128))),
)

CONFIGS: dict[str, BatchingConfig] = {
    # the autopilot keeps mlp's p99 under 50 ms (the dashboard's default SLO) through the
    # phases; its decisions are markers on the timeline
    "mlp": BatchingConfig(max_batch_size=32, max_queue_size=256, max_queue_delay_ms=2.0,
                          autopilot_slo_p99_ms=50.0),
    # mlp shares the device with the encoder and waits behind its batches: the token limit
    # keeps an encoder batch near 30 ms on the CPU, under mlp's SLO. The memory budget
    # (about 1.75 MB of activations per 128 tokens) makes the batches near that limit run
    # out of memory, so the demo shows OOM recovery: split, back off, probe
    "encoder": BatchingConfig(policy="adaptive", max_batch_size=16, max_queue_size=96,
                              pad_to="batch_max",  # bucket edges derived from the traffic
                              max_batch_tokens=256, memory_budget_mb=3.0,
                              oom_probe_after_batches=40),
}


PROMPTS = ("The batching window", "Queues form when", "A GPU waits for", "Latency is")


async def completions(url: str, flow: Flow, rate_rps: float, duration_s: float,
                      seed: int) -> str:
    """Poisson completions requests to ``/v1/completions``; returns a one-line summary."""
    import random

    import httpx

    rng = random.Random(seed)
    outcomes: dict[int, int] = {}

    async def one(client: httpx.AsyncClient) -> None:
        body = {"model": flow.model, "prompt": rng.choice(PROMPTS),
                "max_tokens": rng.randint(4, flow.max_tokens), "temperature": 0.8,
                "seed": rng.randint(0, 1 << 30)}
        try:
            r = await client.post("/v1/completions", json=body)
            outcomes[r.status_code] = outcomes.get(r.status_code, 0) + 1
        except httpx.HTTPError:
            outcomes[0] = outcomes.get(0, 0) + 1

    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        tasks = []
        while True:
            await asyncio.sleep(rng.expovariate(rate_rps))
            if loop.time() >= end:
                break
            tasks.append(asyncio.ensure_future(one(client)))
        await asyncio.gather(*tasks)
    return f"completions on {flow.model!r}: answers by status {outcomes}"


async def run_phase(url: str, phase: Phase, *, intensity: float = 1.0, seed: int = 0,
                    models: Sequence[str] = ("mlp", "encoder", "decoder")) -> list[Any]:
    """Run every flow of ``phase`` on ``models`` at once; returns their reports."""
    from batchscope.load.loadgen import run_load_async

    runs = []
    for k, f in enumerate(phase.flows):
        if f.model not in models:
            continue
        rate = max(0.2, f.rate_rps * intensity)
        if f.max_tokens:
            runs.append(completions(url, f, rate, phase.duration_s, seed + k))
        else:
            runs.append(run_load_async(url, f.model, rate=rate, duration_s=phase.duration_s,
                                       lengths=f.lengths, priority=f.priority,
                                       timeout_ms=f.timeout_ms, bypass=f.bypass, seed=seed + k,
                                       max_connections=64, adapters=f.adapters))
    return list(await asyncio.gather(*runs, return_exceptions=True))


async def drive(url: str, phases: Sequence[Phase] = PHASES, *, intensity: float = 1.0,
                cycles: int | None = None, models: Sequence[str] = ("mlp", "encoder", "decoder"),
                ) -> None:
    """Cycle through ``phases`` (forever when ``cycles`` is None)."""
    cycle = 0
    while cycles is None or cycle < cycles:
        for phase in phases:
            reports = await run_phase(url, phase, intensity=intensity, seed=cycle * 100,
                                      models=models)
            for report in reports:
                if isinstance(report, BaseException):
                    log.warning("demo phase %s: traffic failed: %s", phase.name, report)
                else:
                    text = report if isinstance(report, str) else report.summary()
                    log.info("demo phase %s: %s", phase.name, text.replace("\n", "; "))
        cycle += 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.tools.demo",
                                     description="BatchScope demo runtime with synthetic traffic")
    parser.add_argument("--db", default=None, help="SQLAlchemy URL to record into")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--intensity", type=float, default=1.0, help="scale every traffic rate")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--no-generation", action="store_true",
                        help="leave out the generation model (decoder)")
    parser.add_argument("--cycles", type=int, default=None,
                        help="stop after this many passes through the phases (default: never)")
    parser.add_argument("--no-autopilot", action="store_true",
                        help="serve mlp with the same settings but the autopilot off")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.cycles is not None and args.cycles < 1:
        print("python -m runtime.tools.demo: --cycles must be 1 or more", file=sys.stderr)
        return 2
    if not args.intensity > 0:
        print("python -m runtime.tools.demo: --intensity must be above 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    import torch

    from batchscope.storage.db import default_url
    from runtime.tools.cli import load_models
    from runtime.server.service import VERSION, Service, ServiceThread

    torch.set_num_threads(max(1, args.torch_threads))
    specs = ["mlp", "encoder"] + ([] if args.no_generation else ["decoder"])
    server = ServerConfig(host=args.host, port=args.port, database_url=args.db or default_url(),
                          models=tuple(specs))
    models, generation = load_models(specs)
    configs = dict(CONFIGS)
    if args.no_autopilot:
        configs = {name: replace(c, autopilot_slo_p99_ms=None) for name, c in configs.items()}
    # the encoder's adapters: small files written once into the user's cache and reused
    # (a demo killed with SIGKILL leaves nothing behind); a temporary folder, gone with the
    # demo, where there is no cache to write
    try:
        adapter_root, own_root = cached_root(), None
        paths = write_demo_adapters(adapter_root, len(ADAPTERS))
    except OSError as exc:
        logging.getLogger(__name__).info("demo adapters in a temporary folder: the cache "
                                         "cannot be written (%s)", exc)
        adapter_root = own_root = tempfile.mkdtemp(prefix="batchscope-demo-adapters-")
        paths = write_demo_adapters(adapter_root, len(ADAPTERS))
    service = Service(models, configs, server, generation=generation, version=f"{VERSION}-demo",
                      adapters=[("encoder", name, path) for name, path in paths.items()])
    runner = ServiceThread(service, host=args.host, port=args.port)
    try:
        url = runner.start()
    except BaseException:
        if own_root:
            shutil.rmtree(own_root, ignore_errors=True)
        raise
    print(f"batchscope demo on {url}  models: {', '.join(specs)}  adapters: encoder "
          f"{ADAPTERS[0]}..{ADAPTERS[-1]}  database: {server.database_url}", flush=True)

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    # the traffic comes from a process of its own, as clients do: generating it in this
    # process would put its work under the server's interpreter lock, and the latencies
    # the dashboard shows would be the load generator's as much as the server's
    driver = multiprocessing.get_context("spawn").Process(
        target=drive_process, name="batchscope-demo-traffic", daemon=True,
        args=(url, args.intensity, args.cycles, tuple(specs), os.getpid(), args.log_level))
    try:
        driver.start()
        while driver.is_alive():
            driver.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if driver.is_alive():
            driver.terminate()
            driver.join(10)
        runner.stop()
        if own_root:
            shutil.rmtree(own_root, ignore_errors=True)
    return 0


def drive_process(url: str, intensity: float, cycles: int | None, models: Sequence[str],
                  parent_pid: int, log_level: str = "WARNING") -> None:
    """The demo's traffic, in a child process; it ends with its cycles, when the demo
    terminates it, or within a second of the demo's death (even by SIGKILL)."""
    import threading

    from batchscope.load.loadgen import run_async

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the demo's to handle
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    def orphaned() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    run_async(drive(url, intensity=intensity, cycles=cycles, models=models))


if __name__ == "__main__":
    sys.exit(main())
