"""The frame of ``benchmarks.gpu_full``: sections with time limits, claims, the JSON file.

A section is a function of a ``Context``. It runs in a thread of its own with a deadline;
one that runs past it is recorded as timed out (the server processes it started are
killed) and the next section starts. After every section the whole summary is rewritten
to the JSON file, so a run that is cut short still reports what it reached.

A section states claims with ``ctx.claim(id, ok, detail)``: ``ok`` True is PASS, False is
FAIL (``detail`` says what differed), None is UNVERIFIED (``detail`` says why). Without a
CUDA device (``--device cpu``, the dry run the suite makes) every claim is UNVERIFIED
with "no CUDA device", and what the section saw on the CPU is kept as ``cpu_result``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

PASS, FAIL, UNVERIFIED = "PASS", "FAIL", "UNVERIFIED"
NO_CUDA = "no CUDA device (--device cpu dry run)"


@dataclass(frozen=True)
class Claim:
    id: str
    text: str
    section: str


@dataclass(frozen=True)
class Section:
    key: str
    fn: Callable[["Context"], dict[str, Any]]
    limit_s: float
    #: skipped, not run, without CUDA
    cuda_only: bool = False
    #: the claims it settles: id -> the claim
    claims: dict[str, str] = field(default_factory=dict)


@dataclass
class Context:
    device: str
    #: small sizes: the dry run on the CPU
    small: bool
    out_dir: Path
    deadline: float = 0.0
    claims: dict[str, dict[str, Any]] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def seconds(self, wanted: float, reserve: float = 5.0) -> float:
        """``wanted`` seconds, or less when the section's deadline is nearer."""
        return max(0.2, min(wanted, self.left() - reserve))

    def claim(self, claim_id: str, ok: bool | None, detail: str = "") -> None:
        if ok is None:
            status = UNVERIFIED
        else:
            status = PASS if ok else FAIL
        self.claims[claim_id] = {"status": status, "detail": detail}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def median_ms(ctx: Context, fn: Callable[[], Any], iters: int) -> float:
    """Median milliseconds of ``fn``: CUDA events on the GPU, the clock on the CPU."""
    times = []
    for _ in range(iters):
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def close_to(a: float, b: float, rel: float, abs_: float) -> bool:
    return abs(a - b) <= max(abs_, rel * abs(b))


class Run:
    """Runs the sections in order under one overall budget and keeps the summary."""

    def __init__(self, ctx: Context, sections: list[Section], claims: list[Claim], out: Path,
                 budget_s: float, limit_scale: float = 1.0) -> None:
        self.ctx, self.sections, self.claims, self.out = ctx, sections, claims, out
        self.budget_end = time.monotonic() + budget_s
        #: each section's limit times this (the CPU dry run: a slow machine's time, not
        #: a lent GPU's, is what it spends)
        self.limit_scale = limit_scale
        self.summary: dict[str, Any] = {"device": ctx.device, "small": ctx.small,
                                        "budget_s": budget_s, "sections": {}, "claims": {}}
        self.stuck: list[threading.Thread] = []

    def write(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.summary, indent=2, default=str))
        os.replace(tmp, self.out)

    def run_all(self) -> dict[str, Any]:
        t_all = time.perf_counter()
        for section in self.sections:
            self.summary["sections"][section.key] = self.one(section)
            self.summary["claims"] = self.verdicts()
            self.summary["wall_s"] = round(time.perf_counter() - t_all, 1)
            self.write()
            print(f"== {section.key}: {self.summary['sections'][section.key]['status']} "
                  f"in {self.summary['sections'][section.key]['wall_s']} s", flush=True)
        return self.summary

    def one(self, section: Section) -> dict[str, Any]:
        ctx = self.ctx
        if section.cuda_only and not ctx.cuda:
            return {"status": "skipped", "wall_s": 0.0, "reason": f"skipped: {NO_CUDA}"}
        left = self.budget_end - time.monotonic()
        if left < 5:
            return {"status": "skipped", "wall_s": 0.0,
                    "reason": "skipped: the overall time budget is spent"}
        limit = min(section.limit_s * self.limit_scale, left)
        ctx.deadline = time.monotonic() + limit
        ctx.cancelled = threading.Event()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = section.fn(ctx)
            except BaseException as exc:  # recorded, never raised: the next section runs
                box["error"] = f"{type(exc).__name__}: {exc}"
                box["trace"] = traceback.format_exc()[-3000:]

        t0 = time.perf_counter()
        thread = threading.Thread(target=target, name=f"gpu-full-{section.key}", daemon=True)
        thread.start()
        thread.join(limit)
        wall = round(time.perf_counter() - t0, 2)
        if thread.is_alive():
            ctx.cancelled.set()
            self.kill_procs()
            thread.join(5)
            if thread.is_alive():
                self.stuck.append(thread)
            return {"status": "timed out", "wall_s": wall, "limit_s": round(limit, 1),
                    "reason": f"timed out after {limit:.0f} s"}
        self.kill_procs()
        if "error" in box:
            return {"status": "error", "wall_s": wall, "reason": box["error"],
                    "trace": box["trace"]}
        return {"status": "done", "wall_s": wall, "limit_s": round(limit, 1),
                "result": box.get("result")}

    def kill_procs(self) -> None:
        for proc in self.ctx.procs:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        self.ctx.procs.clear()

    def verdicts(self) -> dict[str, dict[str, Any]]:
        """Every claim's status so far; a claim of a section not run yet, skipped, timed
        out or failed is UNVERIFIED with the reason."""
        out = {}
        for c in self.claims:
            sec = self.summary["sections"].get(c.section)
            seen = self.ctx.claims.get(c.id)
            row: dict[str, Any] = {"claim": c.text, "section": c.section}
            if sec is None:
                row.update(status=UNVERIFIED, detail="section not reached")
            elif seen is None:
                row.update(status=UNVERIFIED,
                           detail=sec.get("reason") or "the section did not state it")
            elif not self.ctx.cuda:
                row.update(status=UNVERIFIED, detail=NO_CUDA, cpu_result=seen["status"],
                           cpu_detail=seen["detail"])
            else:
                row.update(seen)
            out[c.id] = row
        return out

    def final_lines(self) -> list[str]:
        return [f"{v['status']:10s} {cid}: {v['claim']}"
                + (f" -- {v['detail']}" if v.get("detail") else "")
                for cid, v in self.summary["claims"].items()]
