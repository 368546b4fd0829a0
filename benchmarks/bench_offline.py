"""Offline throughput of each bundled model: no server, no queue, just the model's own
decode -> collate -> predict -> split path, at fixed batch sizes, torch on one thread.

For ``encoder`` two orders are measured: random lengths (8..128, each batch padded to
its longest item) and length-sorted batches (similar lengths together, little padding),
the gap being what length bucketing can win.

    python -m benchmarks.bench_offline                    # mlp and encoder, batch 1/8/32/64
    python -m benchmarks.bench_offline --models encoder --batch-sizes 1,16 --duration-s 2 --json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from benchmarks.common import format_table, make_inputs, set_torch_threads
from runtime.models.loader import load_model
from runtime.api.model import ModelAPI

#: requests per model; a run always covers whole passes over its pool, so every length
#: is sampled alike (variable-length pools are smaller: a pass at batch 1 takes seconds)
POOL_SIZE = {"encoder": 256, "minilm": 256}
DEFAULT_POOL_SIZE = 1024


@dataclass
class OfflineResult:
    model: str
    order: str              # "fixed" | "random" | "sorted"
    batch_size: int
    batches: int
    items: int
    seconds: float
    items_per_s: float
    ms_per_batch: float
    padding_efficiency: float  # real elements / padded elements (1.0 for fixed-size models)
    real_elements_per_s: float  # tokens/s for variable-length models, items/s otherwise
    cpu_seconds: float          # process CPU time: less sensitive than wall time to a busy machine
    items_per_cpu_s: float


def offline_throughput(model: ModelAPI, requests: Sequence[dict], batch_size: int, *,
                       order: str = "random", duration_s: float = 1.0, warmup_batches: int = 2,
                       max_batches: int = 100_000, seed: int = 0) -> OfflineResult:
    """Run batches of ``batch_size`` requests (cycling through ``requests``) for about
    ``duration_s`` seconds, finishing the pass over ``requests`` in progress (so every
    request is counted equally often); each batch goes through decode, collate, predict and split.
    Batches are formed in ``order`` ("random": as given, "sorted": by length) and then
    visited in a seeded shuffled order."""
    if order == "sorted":
        lengths = [model.length(model.decode(r)) for r in requests]
        requests = [requests[i] for i in sorted(range(len(requests)), key=lambda i: lengths[i])]
    chunks = [requests[i:i + batch_size] for i in range(0, len(requests) - batch_size + 1, batch_size)]
    if not chunks:
        raise ValueError(f"need at least {batch_size} requests for batch size {batch_size}")
    random.Random(seed).shuffle(chunks)  # a time-limited run then samples every length alike

    def one(chunk: Sequence[dict]) -> tuple[int, int]:
        items = [model.decode(r) for r in chunk]
        batch = model.collate(items, None)
        model.split(model.predict(batch), len(items))
        if not model.variable_length:
            return len(items), len(items)
        real = sum(model.length(i) for i in items)
        return real, len(items) * max(model.length(i) for i in items)

    for k in range(warmup_batches):
        one(chunks[k % len(chunks)])
    real = padded = batches = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    elapsed = 0.0
    while batches < max_batches and (batches == 0 or elapsed < duration_s or batches % len(chunks)):
        r, p = one(chunks[batches % len(chunks)])
        real, padded, batches = real + r, padded + p, batches + 1
        elapsed = time.perf_counter() - start
    items = batches * batch_size
    cpu_s = max(time.process_time() - cpu_start, 1e-9)
    return OfflineResult(model=model.name, order=order if model.variable_length else "fixed",
                         batch_size=batch_size, batches=batches, items=items, seconds=elapsed,
                         items_per_s=items / elapsed, ms_per_batch=1000 * elapsed / batches,
                         padding_efficiency=real / padded if padded else 1.0,
                         real_elements_per_s=real / elapsed, cpu_seconds=cpu_s,
                         items_per_cpu_s=items / cpu_s)


def run_offline(models: Sequence[str] = ("mlp", "encoder"), batch_sizes: Sequence[int] = (1, 8, 32, 64),
                *, duration_s: float = 1.0, threads: int = 1, device: str = "cpu",
                seed: int = 0, pool_size: int | None = None) -> list[dict[str, Any]]:
    """Every (model, order, batch size) combination, with its speedup over batch 1."""
    set_torch_threads(threads)
    rows: list[dict[str, Any]] = []
    for name in models:
        model = load_model(name)
        model.setup(device)
        requests = make_inputs(name, pool_size or POOL_SIZE.get(name, DEFAULT_POOL_SIZE), seed=seed)
        orders = ("random", "sorted") if model.variable_length else ("fixed",)
        base: dict[str, float] = {}
        for bs in batch_sizes:          # orders interleaved: load drift hits both alike
            for order in orders:
                res = asdict(offline_throughput(model, requests, bs, order=order, duration_s=duration_s))
                base.setdefault(order, res["items_per_s"])
                res["speedup_vs_batch1"] = res["items_per_s"] / base[order]
                rows.append(res)
    _add_sorted_gain(rows)
    return rows


def _add_sorted_gain(rows: list[dict[str, Any]]) -> None:
    random_rows = {(r["model"], r["batch_size"]): r for r in rows if r["order"] == "random"}
    for r in rows:
        other = random_rows.get((r["model"], r["batch_size"]))
        if r["order"] == "sorted" and other is not None:
            r["sorted_vs_random"] = r["items_per_s"] / other["items_per_s"]
            r["sorted_vs_random_cpu"] = r["items_per_cpu_s"] / other["items_per_cpu_s"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,encoder", help="comma-separated model specs")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--duration-s", type=float, default=1.5, help="measuring time per combination")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = run_offline([m for m in args.models.split(",") if m],
                       [int(b) for b in args.batch_sizes.split(",") if b],
                       duration_s=args.duration_s, threads=args.threads, device=args.device)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows, ["model", "order", "batch_size", "items_per_s", "items_per_cpu_s",
                                  "real_elements_per_s",
                                  "ms_per_batch", "padding_efficiency", "speedup_vs_batch1", "sorted_vs_random",
                                  "sorted_vs_random_cpu"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
