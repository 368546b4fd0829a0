"""``compile=<mode>`` of one bundled model against eager, in a process of its own.

``benchmarks.gpu_full``'s ``compile`` section runs this once per model, so that what
torch.compile leaves behind in a process (dispatcher state, the inductor caches, CUDA
graph pools) cannot spill into the next model or section. As the server does, the model
is compiled and run on a worker thread (the device thread); when that fails, it is tried
once more on the main thread, so a failure says whether threads are the cause.

    python -m benchmarks.gpu.compile_probe --model mlp --device cuda:0

prints one JSON object: ``rows`` (per batch size: max |compiled - eager|, eager and
compiled milliseconds, the warm-up seconds) and, when compiling failed, ``error`` and
``traceback`` for the thread and the main-thread attempt.
"""

from __future__ import annotations

import argparse
import json
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import make_inputs
from benchmarks.gpu.harness import Context, median_ms
from runtime.core.clock import MonotonicClock
from runtime.device.compiled import compiled_predict
from runtime.models.loader import load_model

SIZES = (1, 4, 8)


def probe(name: str, device: str, mode: str) -> dict[str, Any]:
    """Compile ``name`` with ``mode`` on this thread and compare it with eager."""
    dev, ctx = torch.device(device), Context(device, False, Path("."))
    model = load_model(name)
    model.setup(dev)
    items = [model.decode(r) for r in make_inputs(name, max(SIZES), seed=5, min_length=20, max_length=64)]
    variable = bool(model.variable_length)
    made = compiled_predict(model, mode, MonotonicClock())
    if made is None or made.error:
        out: dict[str, Any] = {"error": made.error if made else "not compiled"}
        try:  # once more, directly, for the whole traceback
            with torch.inference_mode():
                torch.compile(model.predict, mode=mode)(model.collate(items[:2], 64 if variable else None))
        except Exception:  # noqa: BLE001 - reported
            out["traceback"] = traceback.format_exc()[-6000:]
        return out
    rows: list[dict[str, Any]] = []
    # compiled_predict falls back to ordinary tensors outside inference mode when the
    # compiler fails on inference tensors: say which ran
    outside = "outside_inference_mode" in getattr(made.predict, "__qualname__", "")
    for n in SIZES:
        with torch.inference_mode():
            batch = model.collate(items[:n], 64 if variable else None)
            eager = model.predict(batch)
            got = made.predict(batch)
            got = got.clone() if isinstance(got, torch.Tensor) else got
            diff = float((got - eager).abs().max()) if isinstance(got, torch.Tensor) else 0.0
            eager_ms = median_ms(ctx, lambda: model.predict(batch), 10)
            comp_ms = median_ms(ctx, lambda: made.predict(batch), 10)
        rows.append({"n": n, "max_abs_diff": diff, "eager_ms": round(eager_ms, 4),
                     "compiled_ms": round(comp_ms, 4), "warm_up_s": round(made.warm_up_s, 2),
                     "speedup": round(eager_ms / comp_ms, 2) if comp_ms else None})
    return {"rows": rows, "outside_inference_mode": outside, "counters": inductor_counters(),
            "static_shapes": static_shapes(model, items, variable, mode, ctx)}


def inductor_counters() -> dict[str, Any]:
    """dynamo's and inductor's counters: CUDA graphs skipped (and why, in the log),
    graphs compiled, recompiles."""
    from torch._dynamo.utils import counters

    return {group: dict(counters[group]) for group in ("inductor", "stats", "recompiles")
            if counters.get(group)}


def static_shapes(model: Any, items: list, variable: bool, mode: str, ctx: Context) -> list:
    """The same sizes compiled with ``dynamic=False`` (a graph per shape), directly: what
    the dynamic shapes the runtime's warm-up asks for cost beside it."""
    out = []
    try:
        fn = torch.compile(model.predict, mode=mode, dynamic=False)
        for n in SIZES:
            with torch.inference_mode():
                batch = model.collate(items[:n], 64 if variable else None)
                for _ in range(3):  # record the graph, then replay
                    fn(batch)
                out.append({"n": n, "compiled_ms": round(median_ms(ctx, lambda: fn(batch), 10), 4)})
    except Exception as exc:  # noqa: BLE001 - reported
        out.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
    return out


def guarded(name: str, device: str, mode: str) -> dict[str, Any]:
    try:
        return probe(name, device, mode)
    except Exception as exc:  # noqa: BLE001 - reported, with where it happened
        return {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-4000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mode", default="reduce-overhead")
    args = ap.parse_args()
    with ThreadPoolExecutor(1) as pool:  # as the server: compiled and run on a worker thread
        out = pool.submit(guarded, args.model, args.device, args.mode).result()
    out["thread"] = "worker"
    if "error" in out:
        out = {"worker_thread": out, **guarded(args.model, args.device, args.mode), "thread": "main"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
