"""Every GPU claim of the README and the guides, checked in one run on a lent GPU.

    python -m benchmarks.gpu_full --out DIR            # on the GPU machine (about 6 minutes)
    python -m benchmarks.gpu_full --out DIR --device cpu   # the dry run the suite makes

Each section runs with a time limit and the whole run with an overall budget (8 minutes
by default on a GPU); ``DIR/gpu_full.json`` is rewritten after every section, so a run cut short
still reports what it reached. The last lines printed are one PASS, FAIL or UNVERIFIED
per claim. With ``--device cpu`` the CUDA-only sections are skipped, the others run
small on the CPU, and every claim is UNVERIFIED ("no CUDA device") with what the CPU run
saw beside it. What each section checks and how to read the output: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

import torch

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from benchmarks.gpu import device_checks as dc
from benchmarks.gpu import env_checks, mps_check, workload_checks as wc
from benchmarks.gpu import served, tracing_cost
from benchmarks.gpu.harness import FAIL, Claim, Context, Run, Section

#: the sections in order, each with its time limit and the GPU claims of the README and
#: the guides it settles (claim id -> the claim)
SECTIONS = [
    Section("env", env_checks.env, 30, claims={
        "env.cuda": "a CUDA device is visible to torch",
        "nvtx.ranges": "NVTX ranges around batches and steps show in Nsight Systems",
        "nvtx.tool": "each batch run on CUDA reaches an attached NVTX tool (the interface "
                     "Nsight Systems attaches through) as one range named with its id"}),
    # second, so the overall budget never starves it: its rounds fill its limit
    Section("tracing", tracing_cost.tracing, 150, claims={
        "tracing.timestamps_cost": "Triton timestamps at every request cost at most 3 % of "
                                   "the throughput and 5 % of the p99 (mlp, 64 clients)",
        "tracing.otel_cost": "OpenTelemetry spans for every request cost at most 5 % of the "
                             "throughput",
        "tracing.sampled_cost": "OpenTelemetry spans for 1 request in 100 cost at most 1 % of "
                                "the throughput",
        "tracing.no_drops": "no span is dropped, and the OTLP receiver gets at least 3 spans "
                            "for each request traced in the span modes"}),
    Section("graphs", dc.graphs, 60, claims={
        "graphs.equal": "CUDA graphs through run_batch equal eager at batch 1..8 and 32, "
                        "padded replays included",
        "graphs.faster": "a graph replay is faster than the eager forward pass at batch <= 8",
        "graphs.fallback": "a model that cannot be captured runs eagerly and leaves the thread "
                           "on the default stream"}),
    Section("attribution", dc.attribution, 30, claims={
        "timing.phases": "phase times are the GPU time of each phase (CUDA events)",
        "memory.per_batch": "each batch's own memory increase matches the allocator's peak"}),
    Section("graph_life", dc.graph_life, 30, cuda_only=True, claims={
        "graphs.kept": "a new max_batch_size keeps the graphs already captured",
        "graphs.bucket_edges": "a variable-length batch is captured only at a bucket edge"}),
    Section("capture_while_decoding", dc.capture_while_decoding, 45, cuda_only=True, claims={
        "graphs.capture_concurrent": "the decoder's steps go on while graphs are captured"}),
    Section("serve", served.serve, 120, claims={
        "serve.load": "serve --device cuda answers 64 connections with graphs off and on "
                      "(switched through the control API) without errors",
        "serve.graphs_recorded": "batches after the switch run as graph replays, so recorded",
        "telemetry.nvml_db": "NVML device samples are recorded in the database",
        "serve.decoder_text": "the decoder's greedy text on CUDA equals the CPU's"}),
    Section("device_process", served.device_process, 60, claims={
        "device_process.throughput": "the device process serves on CUDA",
        "device_process.sigkill": "a SIGKILLed device process is replaced, serving goes on"}),
    Section("server_oom", served.server_oom, 50, cuda_only=True, claims={
        "oom.server": "a real CUDA out-of-memory error through the server: cap lowered, no 5xx, "
                      "throughput recovers"}),
    Section("generation", wc.generation, 60, claims={
        "generation.continuous": "continuous batching outperforms static on the GPU"}),
    Section("model_files", wc.model_files, 45, claims={
        "files.hf": "an hf: model (all-MiniLM-L6-v2, else a tiny BERT made there) on CUDA equals the CPU",
        "files.pt2": "a pt2: model (the encoder, exported there) on CUDA equals the CPU",
        "files.onnx_cuda": "an onnx: model with provider=cuda equals provider=cpu"}),
    Section("compile", wc.compile_modes, 90, cuda_only=True, claims={
        "compile.reduce_overhead": "compile=reduce-overhead equals eager on CUDA (time beside)"}),
    Section("speculation", wc.speculation, 60, claims={
        "speculation.same_tokens": "speculative decoding keeps the greedy tokens on the GPU",
        "speculation.faster_at_batch_1": "speculative decoding raises tokens/s at batch 1",
        "speculation.auto_switch": "batched, the auto-switch keeps tokens/s >= 0.95x of no "
                                   "speculation"}),
    Section("chunked_prefill", wc.chunked_prefill, 30, claims={
        "chunked_prefill.same_tokens": "chunked prefill keeps every sequence's tokens",
        "chunked_prefill.itl": "chunked prefill lowers the running sequences' p99 inter-token "
                               "latency"}),
    Section("mps", mps_check.mps, 90, cuda_only=True, claims={
        "mps.detected": "two instances under CUDA MPS serve at once, each registers its share "
                        "(a private daemon where the machine has none)"}),
]
CLAIMS = [Claim(cid, text, s.key) for s in SECTIONS for cid, text in s.claims.items()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_full", help="folder for gpu_full.json and the databases")
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for the dry run")
    p.add_argument("--budget-s", type=float, default=None,
                   help="overall time budget (default 470 s on CUDA; on the CPU 900 s)")
    p.add_argument("--limit-scale", type=float, default=None,
                   help="each section's time limit times this (default 1 on CUDA; 5 on the "
                        "CPU, whose dry run only checks the plumbing, at the machine's pace)")
    p.add_argument("--only", default=None, help="comma-separated section keys to run")
    a = p.parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = a.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: running the dry run (--device cpu)", flush=True)
        device = "cpu"
    torch.set_num_threads(1)
    ctx = Context(device=device, small=not device.startswith("cuda"), out_dir=out_dir)
    sections = SECTIONS if not a.only else [s for s in SECTIONS if s.key in a.only.split(",")]
    budget = a.budget_s or (470.0 if ctx.cuda else 900.0)
    scale = a.limit_scale or (1.0 if ctx.cuda else 5.0)
    run = Run(ctx, sections, CLAIMS, out_dir / "gpu_full.json", budget, limit_scale=scale)
    summary = run.run_all()
    lines = run.final_lines()
    print("\n".join(lines), flush=True)
    print(f"wall {summary['wall_s']} s, device {device}; {out_dir / 'gpu_full.json'}", flush=True)
    code = 1 if any(v["status"] == FAIL for v in summary["claims"].values()) else 0
    code = code or int(any(s["status"] in ("error", "timed out")
                           for s in summary["sections"].values()))
    if run.stuck:  # a section's thread is still running: do not wait for it
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
