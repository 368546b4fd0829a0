"""``benchmarks.gpu_full``: the dry run on the CPU (every section reported, every claim
with a status, the CUDA ones UNVERIFIED for want of a device), and the harness's time
limits."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchmarks.gpu.harness import Claim, Context, Run, Section
from benchmarks.gpu_full import CLAIMS, SECTIONS


def test_the_dry_run_reports_every_section_and_claim(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_full", "--device", "cpu",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_full.json").read_text())
    sections = doc["sections"]
    assert set(sections) == {s.key for s in SECTIONS}
    for s in SECTIONS:
        got = sections[s.key]
        if s.cuda_only:
            assert got["status"] == "skipped" and "no CUDA device" in got["reason"], got
        else:
            assert got["status"] == "done", (s.key, got.get("reason"), got.get("trace"))
    claims = doc["claims"]
    assert set(claims) == {c.id for c in CLAIMS}
    for cid, c in claims.items():
        assert c["status"] == "UNVERIFIED" and "no CUDA device" in c["detail"], (cid, c)
    # the plumbing the GPU run depends on worked on the CPU
    for cid in ("serve.load", "serve.decoder_text", "device_process.sigkill",
                "speculation.same_tokens", "chunked_prefill.same_tokens", "graphs.fallback",
                "tracing.no_drops"):
        assert claims[cid]["cpu_result"] == "PASS", (cid, claims[cid])
    tail = done.stdout.strip().splitlines()[-len(CLAIMS) - 1:-1]
    assert [line.split()[0] for line in tail] == ["UNVERIFIED"] * len(CLAIMS)


def test_a_section_past_its_limit_is_recorded_and_the_next_runs(tmp_path):
    def slow(ctx):
        while not ctx.cancelled.is_set():
            time.sleep(0.05)
        return {}

    def fine(ctx):
        ctx.claim("b.ok", True, "ran")
        return {"x": 1}

    def broken(ctx):
        raise ValueError("boom")

    ctx = Context("cuda:0", small=True, out_dir=tmp_path)
    claims = [Claim("a.ok", "a", "a"), Claim("b.ok", "b", "b"), Claim("c.ok", "c", "c")]
    run = Run(ctx, [Section("a", slow, 0.5), Section("b", fine, 5), Section("c", broken, 5)],
              claims, tmp_path / "out.json", budget_s=30)
    summary = run.run_all()
    assert summary["sections"]["a"]["status"] == "timed out"
    assert summary["sections"]["b"]["result"] == {"x": 1}
    assert summary["sections"]["c"]["status"] == "error" and "boom" in summary["sections"]["c"]["reason"]
    on_disk = json.loads((tmp_path / "out.json").read_text())["claims"]
    assert on_disk["a.ok"]["status"] == "UNVERIFIED" and "timed out" in on_disk["a.ok"]["detail"]
    assert on_disk["b.ok"]["status"] == "PASS"
    assert on_disk["c.ok"]["status"] == "UNVERIFIED" and "boom" in on_disk["c.ok"]["detail"]
