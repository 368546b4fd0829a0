"""A short check to run on a machine with a CUDA GPU (well under 2 minutes).

1. CUDA graphs: for ``mlp`` and ``encoder`` (length 64) at batch 1, 2, 4, 8, the graph
   output must match eager execution; the time per batch of both is measured.
2. Device telemetry through NVML (``batchscope.telemetry.DeviceSampler``).
3. A provoked CUDA out-of-memory error is caught as ``torch.cuda.OutOfMemoryError``
   and the device keeps working afterwards.
4. A model whose forward pass synchronises cannot be captured: the runner must fall
   back to eager execution and remember it.
5. Batches through the executor's ``run_batch`` as the server runs them: padded encoder
   batches at bucket edges, eager and replayed (equal outputs, phase times, each
   batch's own memory increase), and split-and-retry on a real out-of-memory error.

``--device cpu`` is the dry run the test suite makes: section 5 without graphs or the
out-of-memory part, the others skipped.

Each section writes its result into the JSON summary as soon as it finishes:

    python -m benchmarks.gpu_check --out gpu_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from benchmarks.common import make_inputs
from batchscope.storage.records import ListRecorder
from batchscope.telemetry import DeviceSampler
from runtime.device import memory as devicemem
from runtime.device.cudagraphs import CudaGraphRunner
from runtime.models.loader import load_model
from runtime.models.mlp import MLPModel

BATCH_SIZES = (1, 2, 4, 8)


def _timed_ms(fn: Callable[[], Any], iters: int) -> float:
    """Median milliseconds of one call, synchronising around each."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def check_graphs(device: str, iters: int) -> list[dict[str, Any]]:
    rows = []
    for name in ("mlp", "encoder"):
        model = load_model(name)
        model.setup(device)
        runner = CudaGraphRunner(model, device, capture_sizes=BATCH_SIZES, max_batch_size=max(BATCH_SIZES))
        requests = make_inputs(name, max(BATCH_SIZES), seed=7, min_length=20, max_length=64)
        for n in BATCH_SIZES:
            items = [model.decode(r) for r in requests[:n]]
            batch = model.collate(items, 64 if model.variable_length else None)
            eager = model.predict(batch)
            out, as_graph = runner.run(batch, n)
            err = float((out - eager).abs().max())
            eager_ms = _timed_ms(lambda: model.predict(batch), iters)
            graph_ms = _timed_ms(lambda: runner.run(batch, n), iters)
            rows.append({"model": name, "batch_size": n, "ran_as_graph": as_graph, "max_abs_diff": err,
                         "matches_eager": bool(as_graph and err < 1e-3), "eager_ms": eager_ms,
                         "graph_ms": graph_ms, "speedup": eager_ms / graph_ms if graph_ms else None})
            print(f"{name:8s} n={n}: graph={as_graph} diff={err:.2e} eager {eager_ms:.3f} ms "
                  f"graph {graph_ms:.3f} ms x{eager_ms / graph_ms:.2f}", flush=True)
        rows.append({"model": name, "runner_stats": runner.stats()})
    return rows


def check_nvml(device: str) -> dict[str, Any]:
    """Two device samples around some work; ``ok`` only when they came from NVML (a GPU
    sample with memory figures), not the CPU fallback."""
    sampler = DeviceSampler("gpu-check", ListRecorder(), torch_device=device)
    x = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        x = x @ x / 64
    first = sampler.sample()[0]
    torch.cuda.synchronize()
    second = sampler.sample()[0]
    sampler.stop()
    ok = sampler.kind == "gpu" and all(r.memory_total_bytes for r in (first, second))
    return {"describe": sampler.describe(), "kind": sampler.kind, "ok": ok,
            "samples": [dataclasses.asdict(r) for r in (first, second)]}


def check_oom(device: str) -> dict[str, Any]:
    total = torch.cuda.get_device_properties(device).total_memory
    result: dict[str, Any] = {"total_bytes": int(total)}
    try:
        torch.empty(int(total * 2), dtype=torch.uint8, device=device)
        result["caught_as_OutOfMemoryError"] = False
    except torch.cuda.OutOfMemoryError as exc:
        result["caught_as_OutOfMemoryError"] = True
        result["message"] = str(exc).splitlines()[0][:200]
    devicemem.free_cached(device)
    model = MLPModel()
    model.setup(device)
    out = model.predict(model.collate([r["INPUT0"] for r in make_inputs("mlp", 4)], None))
    result["works_after"] = bool(torch.isfinite(out).all())
    result["memory"] = devicemem.figures(device)
    return result


class GreedyMLP(MLPModel):
    """Allocates ``bytes_per_item`` of scratch per item in its forward pass, so a batch
    past a memory cap runs out of memory while its halves fit."""

    name = "greedy-mlp"
    bytes_per_item = 64 << 20

    def predict(self, batch):
        scratch = torch.empty(batch.shape[0] * self.bytes_per_item, dtype=torch.uint8,
                              device=batch.device)
        scratch.fill_(1)
        return super().predict(batch) + float(scratch[:1].item() - 1)


def check_executor(device: str) -> dict[str, Any]:
    """Batches through the executor's ``run_batch``, as the server runs them:

    * encoder at bucket edges 32 and 64 (padded batches), with and without CUDA graphs:
      outputs equal, the phase times (collate / predict / split) and each batch's own
      memory increase;
    * split-and-retry on a real out-of-memory error: ``GreedyMLP`` under a memory cap
      that a batch of 8 passes and a batch of 4 does not (CUDA only).

    Runs on the CPU too (no graphs, no OOM part): what the suite's dry run checks."""
    from runtime.api.config import BatchingConfig
    from runtime.core.clock import MonotonicClock
    from runtime.device.executor import graph_runner, run_batch

    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    clock = MonotonicClock()
    out: dict[str, Any] = {"device": str(dev)}
    model = load_model("encoder")
    model.setup(device)
    requests = make_inputs("encoder", 8, seed=11, min_length=20, max_length=64)
    items = [model.decode(r) for r in requests]
    lengths = [model.length(i) for i in items]
    runs = []
    graphs: dict[str, Any] = {}

    def graphs_for(cfg: BatchingConfig) -> Any:
        graphs["runner"] = graph_runner(graphs.get("runner"), model, dev, cfg.max_batch_size)
        return graphs["runner"]

    for use_graphs in ((False, True) if on_cuda else (False,)):
        cfg = BatchingConfig(max_batch_size=8, bucket_edges=(32, 64), pad_to="bucket",
                             cuda_graphs=use_graphs)
        for n, edge in ((8, 64), (4, 64), (2, 64), (8, 64)):
            part = items[:n]
            attempts = run_batch(model, part, lengths[:n], edge, edge, cfg, True, dev, clock,
                                 graphs_for, seq=len(runs), name="encoder")
            a = attempts[-1]
            runs.append({"graphs": use_graphs, "n": n, "pad_to": edge, "outcome": a.outcome,
                         "cuda_graph": a.cuda_graph, "input_ms": 1000 * a.input_s,
                         "compute_ms": 1000 * a.compute_s, "output_ms": 1000 * a.output_s,
                         "peak_bytes": a.peak_memory_bytes,
                         "peak_increase_bytes": getattr(a, "peak_memory_increase_bytes", None),
                         "first_output": a.outputs[0] if a.outputs else None})
    out["runs"] = [{k: v for k, v in r.items() if k != "first_output"} for r in runs]
    eager = [r for r in runs if not r["graphs"]]
    replayed = [r for r in runs if r["graphs"]]
    out["all_ok"] = all(r["outcome"] == "ok" for r in runs)
    if replayed:
        diffs = []
        for e, g in zip(eager, replayed):
            a, b = e["first_output"], g["first_output"]
            diffs.append(max(float(abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a))
        out["graph_vs_eager_max_abs_diff"] = max(diffs)
        out["replayed_as_graph"] = sum(bool(r["cuda_graph"]) for r in replayed)
        out["graph_stats"] = graphs["runner"].stats() if graphs.get("runner") else None
        out["all_ok"] = out["all_ok"] and max(diffs) < 1e-3 and out["replayed_as_graph"] >= 2
    if on_cuda:
        out["split_and_retry"] = _split_and_retry(dev, clock)
        out["all_ok"] = out["all_ok"] and out["split_and_retry"].get("ok", False)
    else:
        out["split_and_retry"] = "skipped: needs CUDA"
    return out


def _split_and_retry(dev: Any, clock: Any) -> dict[str, Any]:
    """A batch of 8 that runs out of memory under a cap is split, and its halves fit."""
    from runtime.api.config import BatchingConfig
    from runtime.device.executor import run_batch

    model = GreedyMLP()
    model.setup(str(dev))
    devicemem.free_cached(dev)
    base = torch.cuda.memory_allocated(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = base + 6 * GreedyMLP.bytes_per_item  # 4 items fit, 8 do not
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    try:
        items = [r["INPUT0"] for r in make_inputs("mlp", 8)]
        attempts = run_batch(model, items, None, None, None, BatchingConfig(max_batch_size=8),
                             False, dev, clock, None, seq=0, name=model.name)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        devicemem.free_cached(dev)
    seen = [(a.start, a.stop, a.outcome) for a in attempts]
    answered = sorted((a.start, a.stop) for a in attempts if a.outcome == "ok" and not a.split)
    ok = attempts[0].outcome == "oom" and sum(z - s for s, z in answered) == 8
    return {"attempts": seen, "ok": ok, "cap_bytes": int(cap)}


class SyncingMLP(MLPModel):
    """Reads a value back to the host inside the forward pass: not capturable."""

    name = "syncing-mlp"

    def predict(self, batch):
        out = super().predict(batch)
        if float(out.sum().item()) == float("inf"):
            return out * 0
        return out


def check_fallback(device: str) -> dict[str, Any]:
    model = SyncingMLP()
    model.setup(device)
    runner = CudaGraphRunner(model, device, capture_sizes=(1, 2, 4), max_batch_size=4)
    batch = model.collate([r["INPUT0"] for r in make_inputs("mlp", 3)], None)
    out1, g1 = runner.run(batch, 3)
    out2, g2 = runner.run(batch, 3)
    return {"first_ran_as_graph": g1, "second_ran_as_graph": g2,
            "outputs_equal": bool(torch.allclose(out1, out2)), "stats": runner.stats()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CUDA graphs, NVML and OOM checks on a GPU")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    summary: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if args.device == "cpu":  # the dry run: what runs without a GPU, the rest skipped
        summary["executor"] = check_executor("cpu")
        summary["skipped"] = "graphs, nvml, oom, fallback and split-and-retry need CUDA"
        summary["all_ok"] = summary["executor"]["all_ok"]
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2, default=str)
        print(json.dumps(summary, indent=2, default=str))
        return 0 if summary["all_ok"] else 1
    if not torch.cuda.is_available():
        summary["error"] = "no CUDA device: run this on a GPU machine"
        print(json.dumps(summary))
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2)
        return 1
    torch.set_num_threads(1)
    summary["device_name"] = torch.cuda.get_device_name(args.device)
    sections = [("graphs", lambda: check_graphs(args.device, args.iters)),
                ("nvml", lambda: check_nvml(args.device)),
                ("oom", lambda: check_oom(args.device)),
                ("fallback", lambda: check_fallback(args.device)),
                ("executor", lambda: check_executor(args.device))]
    ok = True
    for key, fn in sections:
        t0 = time.perf_counter()
        try:
            summary[key] = fn()
        except Exception as exc:
            ok = False
            summary[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        summary[f"{key}_s"] = round(time.perf_counter() - t0, 2)
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2, default=str)
        print(f"== {key} done in {summary[f'{key}_s']} s", flush=True)
    graphs = [r for r in summary.get("graphs", []) if isinstance(r, dict) and "batch_size" in r]
    ok = ok and bool(graphs) and all(r["matches_eager"] for r in graphs)
    ok = ok and summary.get("oom", {}).get("caught_as_OutOfMemoryError") is True
    ok = ok and summary.get("fallback", {}).get("second_ran_as_graph") is False
    ok = ok and summary.get("nvml", {}).get("ok") is True
    ok = ok and summary.get("executor", {}).get("all_ok") is True
    summary["all_ok"] = ok
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=2, default=str)
    print(json.dumps({k: v for k, v in summary.items() if k != "graphs"}, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
