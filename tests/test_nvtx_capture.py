"""``--nvtx`` read back through NVTX's own tool interface, the one Nsight Systems uses.

``benchmarks/gpu/nvtx_tool.c`` is built here and attached to a real server with
``NVTX_INJECTION64_PATH``: every batch must show as one closed range in the
``batchscope`` domain, named ``batch <id> <model> n=<size>`` with the batch id as its
payload, the id and size of its row in the database; every generation step as a
``step`` range. NVTX needs no GPU, so this runs on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import create_engine, text

from benchmarks.gpu.nvtx_tool import build, capture_env, read_ranges
from tests.factories import serving

pytestmark = pytest.mark.slow
MLP_BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32",
                        "data": [0.5] * 256}]}


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("nvtx"))
    if lib is None:
        pytest.skip("no C compiler to build the NVTX tool")
    return lib


def test_every_batch_and_step_is_one_named_range_with_its_id(tool, tmp_path):
    capture, db = tmp_path / "ranges.tsv", tmp_path / "nvtx.db"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **capture_env(tool, capture)}
    with serving(["--model", "mlp", "--model", "decoder", "--nvtx", "--port", "0",
                  "--db", f"sqlite:///{db}"], env=env) as url:
        with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda _: http.post("/v2/models/mlp/infer", json=MLP_BODY)
                                  .status_code, range(64)))
            done = http.post("/v1/completions", json={"model": "decoder", "prompt": [1, 2, 3],
                                                     "max_tokens": 6, "ignore_eos": True})
    assert codes == [200] * 64 and done.status_code == 200
    with create_engine(f"sqlite:///{db}").connect() as conn:
        batches = conn.execute(text("SELECT seq, batch_size FROM batches WHERE model = 'mlp' "
                                    "AND outcome = 'ok'")).all()
    assert sum(size for _, size in batches) == 64

    ranges = read_ranges(capture)
    assert ranges and all(r.domain == "batchscope" and r.closed for r in ranges)
    mlp = {r.payload: r for r in ranges if r.message.startswith("batch ") and " mlp " in r.message}
    assert set(mlp) == {seq for seq, _ in batches}  # one range per batch, keyed by its id
    for seq, size in batches:
        assert mlp[seq].message == f"batch {seq} mlp n={size}" and mlp[seq].payload_type == 2
    assert all(r.pid != os.getpid() for r in ranges)
    steps = [r for r in ranges if r.message.startswith("step ") and " decoder " in r.message]
    assert len(steps) >= 6  # a prefill step, then one per further token
    assert all("running=1" in r.message for r in steps)
    assert [r.payload for r in steps] == sorted(r.payload for r in steps)


def test_unique_batch_messages_are_not_kept_once_their_range_is_sent(tool, tmp_path):
    """nvtx's ``Domain.get_event_attributes`` caches every message it registers, without
    bound; with a profiler attached for hours that is a string kept per batch."""
    capture = tmp_path / "ranges.tsv"
    script = (
        "import nvtx\n"
        "from runtime.device import nvtx as ranges\n"
        "assert ranges.SOURCE == 'nvtx', ranges.SOURCE\n"
        "for seq in range(2000):\n"
        "    with ranges.batch_range(seq, 'mlp', 8):\n"
        "        pass\n"
        "print(nvtx.get_domain('batchscope').get_registered_string.cache_info().currsize)\n")
    env = {**os.environ, **capture_env(tool, capture), "BATCHSCOPE_NVTX": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == ["0"]
    got = read_ranges(capture)
    assert len(got) == 2000 and all(r.closed for r in got)
    assert [r.payload for r in got] == list(range(2000))
    assert got[1999].message == "batch 1999 mlp n=8"
