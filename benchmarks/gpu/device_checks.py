"""The executor's sections of ``benchmarks.gpu_full`` (CUDA graphs, phase times and memory,
graphs kept and captured at bucket edges, capture while the decoder steps) and what the
other in-process sections share (``Batches``, ``max_diff``). Each section takes a
``Context`` and returns its figures, stating its claims with ``ctx.claim``. The others are
in ``benchmarks.gpu.env_checks`` and ``benchmarks.gpu.workload_checks``, the server
sections in ``benchmarks.gpu.served``; what each section checks is in docs/gpu.md."""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch

from benchmarks.common import make_inputs
from benchmarks.gpu.harness import Context, close_to, median_ms
from benchmarks.gpu_check import SyncingMLP, check_fallback
from runtime.api.config import BatchingConfig
from runtime.core.clock import MonotonicClock
from runtime.device.cudagraphs import CudaGraphRunner, select_size
from runtime.device.executor import graph_runner, run_batch
from runtime.models.loader import load_model

TOLERANCE = 1e-3


def max_diff(a: Sequence[dict], b: Sequence[dict]) -> float:
    """The largest absolute difference between two lists of per-item output dicts."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for k in x:
            ax, ay = np.asarray(x[k]), np.asarray(y[k])
            if ax.dtype.kind in "fiu":
                worst = max(worst, float(np.abs(ax.astype(np.float64) - ay.astype(np.float64)).max()))
            elif not np.array_equal(ax, ay):
                return float("inf")
    return worst


class Batches:
    """One model's requests through the executor's ``run_batch``, as the server runs them
    (bucket edges 32 and 64, padded to the bucket), with a CUDA-graph runner kept
    across calls."""

    def __init__(self, ctx: Context, name: Any, count: int, *, seed: int = 7,
                 max_length: int = 64) -> None:
        """``name``: a bundled model's name (its requests made here) or a model instance
        (set ``items`` and ``lengths`` after)."""
        self.ctx, self.dev, self.clock = ctx, torch.device(ctx.device), MonotonicClock()
        self.model = name if not isinstance(name, str) else load_model(name)
        self.model.setup(ctx.device)
        self.name = self.model.name
        self.variable = bool(self.model.variable_length)
        reqs = make_inputs(name, count, seed=seed, min_length=20, max_length=max_length) \
            if isinstance(name, str) else []
        self.items = [self.model.decode(r) for r in reqs]
        self.lengths = [self.model.length(i) for i in self.items] if self.variable else None
        self.runner: CudaGraphRunner | None = None
        self.seq = 0

    def cfg(self, graphs: bool, max_batch_size: int = 32) -> BatchingConfig:
        return BatchingConfig(max_batch_size=max_batch_size, bucket_edges=(32, 64),
                              pad_to="bucket", cuda_graphs=graphs)

    def graphs_for(self, cfg: BatchingConfig) -> Any:
        self.runner = graph_runner(self.runner, self.model, self.dev, cfg.max_batch_size)
        return self.runner

    def run(self, n: int, graphs: bool, edge: int | None = 64, max_batch_size: int = 32,
            pad: int | None = None) -> Any:
        """The last attempt of a batch of the first ``n`` items, in the bucket up to
        ``edge``, padded to ``pad`` (default: the edge, as ``pad_to="bucket"`` does)."""
        return self.attempts(n, graphs, edge, max_batch_size, pad)[-1]

    def attempts(self, n: int, graphs: bool, edge: int | None = 64, max_batch_size: int = 32,
                 pad: int | None = None) -> list[Any]:
        """Every attempt of that batch (more than one when it was split)."""
        edge = edge if self.variable else None
        pad = (pad or edge) if self.variable else None
        self.seq += 1
        attempts = run_batch(self.model, self.items[:n], self.lengths[:n] if self.lengths else None,
                             pad, edge, self.cfg(graphs, max_batch_size), self.variable,
                             self.dev, self.clock, self.graphs_for, seq=self.seq, name=self.name)
        return attempts

    def collated(self, n: int, edge: int = 64) -> Any:
        return self.model.collate(self.items[:n], edge if self.variable else None)


# -- CUDA graphs through the executor -----------------------------------------------------
def graphs(ctx: Context) -> dict[str, Any]:
    """Eager and graph batches through ``run_batch`` at batch 1..8 and 32 (padded to the
    next capture size: a padded replay), their outputs compared; eager and replay times
    with CUDA events; each capture's time; the fallback of a model that cannot be
    captured, and the stream it leaves the thread on."""
    sizes = (1, 2, 3, 8) if ctx.small else (1, 2, 3, 4, 5, 6, 7, 8, 32)
    iters = 2 if ctx.small else 20
    rows, worst, replayed = [], 0.0, 0
    for name in ("mlp", "encoder"):
        b = Batches(ctx, name, max(sizes))
        for n in sizes:
            eager = b.run(n, graphs=False)
            ctx.sync()
            t0 = time.perf_counter()
            first = b.run(n, graphs=True)  # captures when the padded size is new
            ctx.sync()
            capture_ms = (time.perf_counter() - t0) * 1000.0
            again = b.run(n, graphs=True)
            diff = max(max_diff(eager.outputs, first.outputs), max_diff(eager.outputs, again.outputs))
            worst = max(worst, diff)
            replayed += bool(again.cuda_graph)
            batch = b.collated(n)
            runner = b.runner or b.graphs_for(b.cfg(True))  # run_batch makes none on the CPU
            edge = 64 if b.variable else None
            eager_ms = median_ms(ctx, lambda: b.model.predict(batch), iters)
            graph_ms = median_ms(ctx, lambda: runner.run(batch, n, padded_length=edge, bucket_edge=edge), iters)
            rows.append({"model": name, "n": n, "padded_to": select_size(n, runner.sizes),
                         "outcome": again.outcome, "first_as_graph": first.cuda_graph,
                         "replayed_as_graph": again.cuda_graph, "max_abs_diff": diff,
                         "first_run_ms": round(capture_ms, 3), "eager_ms": round(eager_ms, 4),
                         "graph_ms": round(graph_ms, 4),
                         "speedup": round(eager_ms / graph_ms, 2) if graph_ms else None})
        rows.append({"model": name, "runner_stats": b.runner.stats() if b.runner else None})
    batches = [r for r in rows if "n" in r]
    ok = all(r["outcome"] == "ok" for r in batches)
    ctx.claim("graphs.equal", ok and worst < TOLERANCE and replayed == len(batches),
              f"{replayed}/{len(batches)} replayed as graphs, max |graph - eager| {worst:.2e}")
    small = [r["speedup"] for r in batches if r["n"] <= 8 and r["speedup"]]
    ctx.claim("graphs.faster", bool(small) and min(small) > 1.0,
              f"eager / graph time at batch <= 8: {min(small, default=0):.2f}x .. "
              f"{max(small, default=0):.2f}x (CUDA events)")
    fallback = check_fallback(ctx.device)
    stream_ok = True
    if ctx.cuda:
        # the failed capture must leave this thread on the default stream
        model = SyncingMLP()
        model.setup(ctx.device)
        CudaGraphRunner(model, ctx.device, capture_sizes=(2,), max_batch_size=2).run(
            model.collate([r["INPUT0"] for r in make_inputs("mlp", 2)], None), 2)
        stream_ok = torch.cuda.current_stream(ctx.device) == torch.cuda.default_stream(ctx.device)
        fallback["default_stream_after"] = stream_ok
    ctx.claim("graphs.fallback", fallback["second_ran_as_graph"] is False
              and fallback["outputs_equal"] and stream_ok,
              f"not capturable: second run as graph {fallback['second_ran_as_graph']}, outputs "
              f"equal {fallback['outputs_equal']}, default stream after {stream_ok}")
    return {"rows": rows, "fallback": fallback}


# -- timing and memory attribution ----------------------------------------------------------
def attribution(ctx: Context) -> dict[str, Any]:
    """``run_batch``'s compute time against the same forward pass timed by CUDA events,
    and each batch's own memory increase against the allocator's peak measured here."""
    iters = 3 if ctx.small else 15
    rows, time_ok, mem_ok = [], True, True
    for name, n in (("mlp", 32), ("encoder", 8), ("encoder", 32)):
        b = Batches(ctx, name, n, seed=3)
        b.run(n, graphs=False)  # warm up
        timed = EventTimed(ctx, b.model)
        runs = [b.run(n, graphs=False) for _ in range(iters)]
        inside = timed.done()
        # the infer phase (Triton's compute_infer): between the clock reads after collate
        # and after predict, each after a device synchronise
        infer = statistics.median(1000.0 * (a.compute_s - a.input_s - a.output_s) for a in runs)
        total = statistics.median(1000.0 * a.compute_s for a in runs)
        batch = b.collated(n)
        events = median_ms(ctx, lambda: b.model.predict(batch), iters)
        synced = synced_ms(ctx, lambda: b.model.predict(batch), iters)
        row = {"model": name, "n": n, "run_batch_infer_ms": round(infer, 4),
               "inside_event_ms": round(inside, 4) if inside is not None else None,
               "event_ms": round(events, 4), "synced_wall_ms": round(synced, 4),
               "run_batch_compute_ms": round(total, 4),
               "input_ms": round(statistics.median(1000.0 * a.input_s for a in runs), 4),
               "output_ms": round(statistics.median(1000.0 * a.output_s for a in runs), 4)}
        # booked: the forward's wall time between two synchronisations, which holds its
        # GPU time (a launch-only time would be far under it): against CUDA events
        # recorded around the same forward, inside the same run_batch calls
        ref = inside if inside is not None else synced
        row["time_close"] = close_to(infer, ref, 0.2, 0.05) and infer >= 0.95 * ref
        time_ok = time_ok and row["time_close"]
        a = b.run(n, graphs=False)
        row["peak_increase_bytes"] = a.peak_memory_increase_bytes
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device)
            b.model.split(b.model.predict(b.collated(n)), n)  # collate, predict, split as run_batch
            torch.cuda.synchronize(ctx.device)
            here = torch.cuda.max_memory_allocated(ctx.device) - base
            row["allocator_peak_increase_bytes"] = int(here)
            seen = a.peak_memory_increase_bytes or 0
            row["memory_close"] = close_to(seen, here, 0.15, 2 << 20)
            mem_ok = mem_ok and row["memory_close"]
        rows.append(row)
    ctx.claim("timing.phases", time_ok, "; ".join(
        f"{r['model']}@{r['n']}: run_batch infer {r['run_batch_infer_ms']:.3f} ms vs CUDA events "
        f"around the same forward {r['inside_event_ms']} ms (alone in a loop: events "
        f"{r['event_ms']:.3f}, synchronised wall {r['synced_wall_ms']:.3f} ms; collate "
        f"{r['input_ms']:.3f}, split {r['output_ms']:.3f})"
        for r in rows))
    ctx.claim("memory.per_batch", mem_ok if ctx.cuda else None, "; ".join(
        f"{r['model']}@{r['n']}: {r['peak_increase_bytes']} vs {r.get('allocator_peak_increase_bytes')} B"
        for r in rows))
    return {"rows": rows}


class EventTimed:
    """CUDA events recorded around every ``predict`` of ``model`` (an instance attribute
    over the class's method) until ``done``, which gives their median milliseconds (None
    on the CPU)."""

    def __init__(self, ctx: Context, model: Any) -> None:
        self.ctx, self.model, self.pairs = ctx, model, []
        original = model.predict

        def predict(batch: Any) -> Any:
            if not ctx.cuda:
                return original(batch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(batch)
            end.record()
            self.pairs.append((start, end))
            return out

        model.predict = predict

    def done(self) -> float | None:
        del self.model.predict
        if not self.pairs:
            return None
        self.ctx.sync()
        return statistics.median(s.elapsed_time(e) for s, e in self.pairs)


def synced_ms(ctx: Context, fn: Any, iters: int) -> float:
    """Median wall milliseconds of ``fn`` between two device synchronisations, as
    ``run_batch`` clocks each phase."""
    times = []
    for _ in range(iters):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


# -- graph life -------------------------------------------------------------------------
def graph_life(ctx: Context) -> dict[str, Any]:
    """Graphs kept across ``max_batch_size`` changes; a variable-length batch captured
    only at a bucket edge."""
    b = Batches(ctx, "mlp", 32)
    for n in (1, 2, 4, 8):
        b.run(n, graphs=True, max_batch_size=8)
    before = dict(b.runner.stats())
    runner = b.runner
    for mbs in (32, 4, 16):
        for n in (1, 2, 4):
            b.run(n, graphs=True, max_batch_size=mbs)
    after = dict(b.runner.stats())
    kept = b.runner is runner and after["captures"] == before["captures"] \
        and after["replays"] > before["replays"]
    ctx.claim("graphs.kept", kept, f"captures {before['captures']} -> {after['captures']}, replays "
              f"{before['replays']} -> {after['replays']}, same runner {b.runner is runner}")
    e = Batches(ctx, "encoder", 8, max_length=40)
    longest = max(e.lengths[:4])     # pad_to="max": the batch padded to its longest item
    e.run(4, graphs=True, edge=64, pad=longest)   # inside the bucket up to 64, off its edge: eager
    e.run(4, graphs=True, edge=64)                # at the edge: captured
    at_edge = e.run(4, graphs=True, edge=64)
    off_edge = e.run(4, graphs=True, edge=64, pad=longest)
    s = e.runner.stats()
    ctx.claim("graphs.bucket_edges", at_edge.cuda_graph and not off_edge.cuda_graph
              and s["eager_unbucketed"] >= 2 and s["captures"] == 1,
              f"at the edge as graph {at_edge.cuda_graph}, off the edge {off_edge.cuda_graph}; "
              f"captures {s['captures']}, eager off the edge {s['eager_unbucketed']}")
    return {"mlp_before": before, "mlp_after": after, "encoder": s}


# -- capture while the decoder runs ---------------------------------------------------------
def capture_while_decoding(ctx: Context) -> dict[str, Any]:
    """The decoder steps in one thread while another captures graphs: its steps go on
    during the captures, and its greedy tokens equal a run without captures."""
    from runtime.generation.config import GenerationConfig
    from runtime.generation.runner import StepRunner
    from runtime.models.decoder import TinyDecoder

    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(8, 48))] for _ in range(16)]
    config = GenerationConfig(max_model_len=512, num_cache_blocks=512, max_num_seqs=16)

    def decode(during: threading.Event | None, stamps: list[float]) -> list[list[int]]:
        runner = StepRunner(TinyDecoder(max_model_len=512), config, clock=MonotonicClock())
        runner.setup(ctx.device)
        seqs = [runner.new_sequence(p, max_new_tokens=400, ignore_eos=True) for p in prompts]
        while runner.has_work() and not ctx.cancelled.is_set():
            runner.step()
            stamps.append(time.perf_counter())
            if during is not None and during.is_set():
                break
        return [list(s.output_ids) for s in seqs]

    reference = decode(None, [])
    stamps: list[float] = []
    done = threading.Event()
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", decode(done, stamps)), daemon=True)
    thread.start()
    while len(stamps) < 5 and thread.is_alive():
        time.sleep(0.01)
    windows = []
    e = Batches(ctx, "encoder", 32)
    for n in (1, 2, 4, 8, 16, 32):
        t0 = time.perf_counter()
        e.run(n, graphs=True)
        windows.append((t0, time.perf_counter()))
    done.set()
    thread.join(ctx.seconds(60))
    out = box.get("out", [])
    during = sum(1 for t in stamps for a, z in windows if a <= t <= z)
    same = bool(out) and all(o == r[:len(o)] for o, r in zip(out, reference))
    s = e.runner.stats()
    ctx.claim("graphs.capture_concurrent", during > 0 and same and s["captures"] >= 1,
              f"{during} decoder steps inside {len(windows)} capture windows "
              f"({sum(z - a for a, z in windows) * 1000:.0f} ms), tokens equal to a run "
              f"without captures {same}, captures {s['captures']}, deferred {s['capture_deferred']}")
    return {"steps_during_capture": during, "steps": len(stamps), "tokens_equal": same,
            "windows_ms": [round((z - a) * 1000, 2) for a, z in windows], "runner": s}
