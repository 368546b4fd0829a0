"""The server sections of ``benchmarks.gpu_full``: the real ``batchscope serve`` in a
child on a free 127.0.0.1 port, driven with ``tritonclient.http`` when it is importable
(else the project's own load generator), settings changed through
``PATCH /v2/models/NAME/batching``, the recorded database read with SQLAlchemy.

``CappedGreedyMLP`` (``benchmarks.gpu.served:CappedGreedyMLP``) is the model of the
out-of-memory section: it caps its process' CUDA memory in ``setup`` and needs 64 MiB of
scratch per item, so a batch of 8 runs out of memory and its halves fit.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from benchmarks.bench_serving import ROOT, free_port, wait_ready
from benchmarks.common import make_inputs
from benchmarks.gpu.harness import Context
from benchmarks.gpu_check import GreedyMLP

CONNECTIONS = 64


class Server:
    """``batchscope serve ARGS`` in a child, registered with the context so a section
    that runs out of time has it killed; its output lines are kept."""

    def __init__(self, ctx: Context, *args: str, env: dict[str, str] | None = None,
                 start_s: float = 120.0) -> None:
        self.ctx, self.port = ctx, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "runtime.tools.cli", "serve", "--port", str(self.port),
                    "--torch-threads", "1", *args]
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.start_s = start_s
        self.lines: list[str] = []

    def __enter__(self) -> "Server":
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.ctx.procs.append(self.proc)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        try:
            wait_ready(self.url, time.monotonic() + min(self.start_s, self.ctx.left()))
        except RuntimeError:
            raise RuntimeError(f"the server did not start: {''.join(self.lines[-15:])}") from None
        return self

    def _pump(self, lines: queue.Queue) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        return "".join(self.lines[-n:])


def http(url: str, path: str, body: Any = None, method: str = "GET", timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:500]


def drive(url: str, model: str, *, seconds: float, connections: int = CONNECTIONS) -> dict[str, Any]:
    """``connections`` requests in flight for ``seconds``: answers by status and req/s."""
    try:
        import tritonclient.http  # noqa: F401
    except ImportError:
        from batchscope.load.loadgen import run_load

        report = run_load(url, model, concurrency=connections, duration_s=seconds).to_dict()
        report["client"] = "batchscope.load.loadgen (tritonclient is not importable)"
        return report
    return _triton_load(url, model, seconds, connections)


def _triton_load(url: str, model: str, seconds: float, connections: int) -> dict[str, Any]:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    client = httpclient.InferenceServerClient(url.removeprefix("http://"), concurrency=connections,
                                              connection_timeout=60, network_timeout=60)
    bodies = []
    for r in make_inputs(model, 64, seed=4):
        inputs = []
        for name, x in r.items():
            inp = httpclient.InferInput(name, [1, *x.shape], np_to_triton_dtype(x.dtype))
            inp.set_data_from_numpy(x[None])
            inputs.append(inp)
        bodies.append(inputs)
    pending: collections.deque = collections.deque()
    ok, errors, sent = 0, collections.Counter(), 0
    start = time.perf_counter()
    end = start + seconds
    try:
        while time.perf_counter() < end or pending:
            while len(pending) < connections and time.perf_counter() < end:
                pending.append(client.async_infer(model, bodies[sent % len(bodies)]))
                sent += 1
            try:
                pending.popleft().get_result()
                ok += 1
            except InferenceServerException as exc:
                errors[str(exc.status() or "error")] += 1
    finally:
        client.close()
    took = time.perf_counter() - start
    return {"client": "tritonclient.http", "model": model, "connections": connections,
            "sent": sent, "ok": ok, "errors_by_status": dict(errors), "duration_s": round(took, 2),
            "throughput_rps": round(ok / took, 1)}


def _errors(report: dict[str, Any]) -> int:
    return sum(report.get("errors_by_status", {}).values())


def _rows(db_url: str, sql: str, **params: Any) -> list[tuple]:
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def _completion(url: str) -> str:
    status, doc = http(url, "/v1/completions", {"model": "decoder", "prompt": "The batching runtime",
                                                "max_tokens": 24, "temperature": 0}, "POST")
    if status != 200:
        raise RuntimeError(f"/v1/completions answered {status}: {doc}")
    return doc["choices"][0]["text"]


# -- end to end -------------------------------------------------------------------------------
def serve(ctx: Context) -> dict[str, Any]:
    """mlp, encoder and decoder in one server on the device: 64 connections with graphs
    off, then on through the control API; NVML samples in the database; the decoder's
    greedy text against a server on the CPU."""
    db = ctx.out_dir / "serve.db"
    db_url = f"sqlite:///{db}"
    seconds = 1.5 if ctx.small else 6.0
    out: dict[str, Any] = {"loads": []}
    with Server(ctx, "--device", ctx.device, "--model", "mlp", "--model", "encoder", "--model",
                "decoder", "--db", db_url, "--instance-id", "gpu-full") as srv:
        for model in ("mlp", "encoder"):
            drive(srv.url, model, seconds=min(1.0, seconds), connections=8)  # warm up
            off = drive(srv.url, model, seconds=ctx.seconds(seconds, 30))
            status, doc = http(srv.url, f"/v2/models/{model}/batching", {"cuda_graphs": True}, "PATCH")
            on = drive(srv.url, model, seconds=ctx.seconds(seconds, 25))
            _, now = http(srv.url, f"/v2/models/{model}/batching")
            out["loads"].append({"model": model, "graphs_off": off, "patch_status": status,
                                 "graphs_on_after_patch": (now or {}).get("settings", {}).get("cuda_graphs")
                                 if isinstance(now, dict) else None, "graphs_on": on})
        text = _completion(srv.url)
        time.sleep(1.5)  # one more device sample and the recorder's flush
    out["decoder_text"] = text
    if ctx.cuda:
        with Server(ctx, "--device", "cpu", "--model", "decoder", "--no-record") as ref:
            out["decoder_text_cpu"] = _completion(ref.url)
    else:  # the dry run: the device is the CPU already
        out["decoder_text_cpu"] = text
    samples = _rows(db_url, "SELECT kind, COUNT(*), MAX(memory_total_bytes) FROM device_samples "
                            "GROUP BY kind")
    graphs = _rows(db_url, "SELECT model, COUNT(*), SUM(CASE WHEN cuda_graph THEN 1 ELSE 0 END), "
                           "SUM(CASE WHEN outcome = 'ok' THEN 0 ELSE 1 END) FROM batches GROUP BY model")
    out["device_samples"] = {k: {"rows": n, "memory_total_bytes": m} for k, n, m in samples}
    out["batches"] = {m: {"batches": n, "as_graph": g, "not_ok": bad} for m, n, g, bad in graphs}
    loads = out["loads"]
    errors = sum(_errors(r["graphs_off"]) + _errors(r["graphs_on"]) for r in loads)
    patched = all(r["patch_status"] == 200 and r["graphs_on_after_patch"] is True for r in loads)
    as_graph = sum((out["batches"].get(m) or {}).get("as_graph") or 0 for m in ("mlp", "encoder"))
    ctx.claim("serve.load", errors == 0 and patched and all(r["graphs_on"]["ok"] > 0 for r in loads),
              ", ".join(f"{r['model']} {r['graphs_off']['throughput_rps']} -> "
                        f"{r['graphs_on']['throughput_rps']} req/s (graphs off -> on)" for r in loads)
              + f"; errors {errors}; PATCH applied {patched}; client {loads[0]['graphs_on'].get('client')}")
    ctx.claim("serve.graphs_recorded", as_graph > 0, f"{as_graph} batches recorded as CUDA graph "
              "replays after the PATCH")
    gpu = out["device_samples"].get("gpu", {})
    ctx.claim("telemetry.nvml_db", bool(gpu.get("rows")) and bool(gpu.get("memory_total_bytes")),
              f"device samples by kind: {out['device_samples']}")
    ctx.claim("serve.decoder_text", out["decoder_text"] == out["decoder_text_cpu"],
              f"device {out['decoder_text']!r} vs cpu {out['decoder_text_cpu']!r}")
    return out


def device_process(ctx: Context) -> dict[str, Any]:
    """``--device-process`` on the device: throughput, then the child SIGKILLed under
    load, and the server answering again."""
    import psutil

    seconds = 1.5 if ctx.small else 5.0
    out: dict[str, Any] = {}
    with Server(ctx, "--device", ctx.device, "--device-process", "--model", "mlp",
                "--no-record") as srv:
        drive(srv.url, "mlp", seconds=1.0, connections=8)
        out["before"] = drive(srv.url, "mlp", seconds=ctx.seconds(seconds, 30))
        children = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                    if "spawn_main" in " ".join(p.cmdline())]
        if not children:
            raise RuntimeError(f"no device process under the server: {srv.log_tail()}")
        victim = children[0].pid
        box: dict[str, Any] = {}
        loader = threading.Thread(target=lambda: box.setdefault(
            "during", drive(srv.url, "mlp", seconds=ctx.seconds(seconds, 20))), daemon=True)
        loader.start()
        time.sleep(seconds / 3)
        os.kill(victim, signal.SIGKILL)
        loader.join(ctx.seconds(seconds + 30, 10))
        out["during"] = box.get("during")
        out["after"] = drive(srv.url, "mlp", seconds=ctx.seconds(seconds, 10))
        new = [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)
               if "spawn_main" in " ".join(p.cmdline())]
        out["killed_pid"], out["device_pids_after"] = victim, new
        out["log_tail"] = srv.log_tail(8)
    before, after = out["before"], out["after"]
    ctx.claim("device_process.throughput", before["ok"] > 0 and _errors(before) == 0,
              f"{before['throughput_rps']} req/s at {CONNECTIONS} connections, errors {_errors(before)}")
    recovered = after["ok"] > 0 and _errors(after) == 0 and victim not in new and bool(new)
    ctx.claim("device_process.sigkill", recovered,
              f"child {victim} killed; during: {(out['during'] or {}).get('errors_by_status')}; after: "
              f"{after['throughput_rps']} req/s, errors {after.get('errors_by_status')}, new child {new}")
    return out


class CappedGreedyMLP(GreedyMLP):
    """``GreedyMLP`` that caps its own process' CUDA memory in ``setup``: 6 items of
    scratch over what is allocated then (4 items fit, 8 do not)."""

    name = "capped-mlp"

    def setup(self, device: Any = "cpu") -> None:
        super().setup(device)
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev).total_memory
            cap = torch.cuda.memory_allocated(dev) + 6 * self.bytes_per_item
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)


def server_oom(ctx: Context) -> dict[str, Any]:
    """A real CUDA out-of-memory error through the server: batches of 8 under the cap
    run out, the effective max batch size drops, every request is answered 200, and the
    throughput after the errors holds."""
    db_url = f"sqlite:///{ctx.out_dir / 'oom.db'}"
    seconds = 5.0
    out: dict[str, Any] = {}
    with Server(ctx, "--device", ctx.device, "--model", "benchmarks.gpu.served:CappedGreedyMLP",
                "--max-batch-size", "8", "--max-queue-delay-ms", "5", "--db", db_url,
                "--instance-id", "gpu-full-oom") as srv:
        out["first"] = drive(srv.url, "capped-mlp", seconds=ctx.seconds(seconds, 25))
        out["second"] = drive(srv.url, "capped-mlp", seconds=ctx.seconds(seconds, 15))
        time.sleep(1.5)
    events = _rows(db_url, "SELECT kind, COUNT(*) FROM events WHERE kind LIKE 'oom%' GROUP BY kind")
    batches = _rows(db_url, "SELECT outcome, COUNT(*), MAX(batch_size) FROM batches GROUP BY outcome")
    out["events"] = dict(events)
    out["batches"] = {o: {"count": n, "max_size": m} for o, n, m in batches}
    first, second = out["first"], out["second"]
    statuses = {**first.get("errors_by_status", {}), **second.get("errors_by_status", {})}
    ooms = out["events"].get("oom", 0)
    ctx.claim("oom.server", ooms > 0 and not any(s.startswith("5") for s in statuses)
              and second["throughput_rps"] >= 0.5 * first["throughput_rps"] > 0,
              f"oom events {out['events']}, batches {out['batches']}, non-200 {statuses}, "
              f"{first['throughput_rps']} -> {second['throughput_rps']} req/s")
    return out
