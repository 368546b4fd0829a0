"""``batchscope`` end to end through subprocesses: serve, load, shutdown, bad input,
and the demo runtime as the dashboard starts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import text

from batchscope.storage import control
from batchscope.storage.db import make_engine
from tests.factories import first_url, lines_of, serving

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "runtime.tools.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_serve_then_load_then_sigterm(tmp_path):
    url_db = f"sqlite:///{tmp_path / 'cli.db'}"
    with serving(["--model", "mlp", "--port", "0", "--db", url_db, "--torch-threads", "1",
                  "--max-batch-size", "16", "--set", "mlp.max_queue_size=512",
                  "--instance-id", "cli-test", "--heartbeat-interval-s", "0.2"], ENV) as url:
        assert url.startswith("http://127.0.0.1:")
        load = subprocess.run(CLI + ["load", "--url", url, "--model", "mlp", "--concurrency", "8",
                                     "--duration-s", "1", "--max-requests", "300", "--json"],
                              capture_output=True, text=True, timeout=120, env=ENV)
        assert load.returncode == 0, load.stderr
        report = json.loads(load.stdout)
        assert report["mode"] == "closed" and 0 < report["sent"] <= 300
        assert report["ok"] == report["sent"] and report["errors_by_status"] == {}
        assert report["latency_p50_ms"] > 0
    db = make_engine(url_db)
    inst = control.all_instances(db)
    assert [i.id for i in inst] == ["cli-test"] and inst[0].stopped_at is not None
    assert control.current_settings(db, "cli-test", "mlp")[1]["max_batch_size"] == 16
    assert control.current_settings(db, "cli-test", "mlp")[1]["max_queue_size"] == 512
    with db.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM requests WHERE model='mlp' AND outcome='ok'")).scalar()
    assert n == report["ok"]


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.parametrize("args, fragment", ([
    (["serve", "--model", "no_such_model", "--no-record"], "unknown model 'no_such_model'"),
    (["serve", "--max-batch-size", "lots"], "invalid int value: 'lots'"),
    (["serve", "--no-record", "--max-batch-size", "0"], "max_batch_size=0"),
    (["serve", "--no-record", "--set", "mlp.nope=1"], "unknown setting(s) ['nope']"),
    (["serve", "--no-record", "--set", "other.max_batch_size=1"], "NAME one of"),
    (["load", "--lengths", "sometimes"], "--lengths 'sometimes' is not understood"),
    (["load", "--url", "http://127.0.0.1:9", "--duration-s", "1"], "cannot reach"),
    (["load", "--duration-s", "-1"], "--duration-s -1.0 must be a positive"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["serve", "--no-record", "--device", "gpu0"], "--device 'gpu0' is not a device name"),
    (["serve", "--no-record", "--device", "mps"], "only cpu and cuda devices"),
    # a database that cannot be opened, a settings "file" that is a device, bad flags
    (["serve", "--port", "0", "--db", "sqlite:////etc/passwd"],
     "cannot open the database at sqlite:////etc/passwd"),
    (["serve", "--port", "0", "--db", "postgresql+psycopg://u@127.0.0.1:1/db"],
     "serve with --no-record"),
    (["serve", "--no-record", "--port", "0", "--model-config", "mlp=/dev/zero"],
     "it is not a regular file"),
    (["serve", "--no-record", "--port", "0", "--model", "a=mlp", "--model", "a=encoder"],
     "e.g. --model a2=encoder"),
    (["load", "--timeout-ms", "nan"], "--timeout-ms nan must be a positive"),
    (["--log-level", "BOGUS", "trace", "-o", "x.json"], "invalid choice: 'BOGUS'"),
    (["--log-level", "BOGUS", "snapshot", "export", "--out", "x.zip"], "invalid choice: 'BOGUS'"),
    (["--log-level=bogus", "k8s", "--model", "mlp"], "invalid choice: 'bogus'"),
    (["snapshot", "export", "--out", "x.zip", "--db", "sqlite:////no/such/folder/x.db"],
     "there is no SQLite database file"),
    (["snapshot", "export", "--out", "x.zip", "--db", "sqlite:////etc/passwd"],
     "cannot read the database"),
    (["snapshot", "export", "--out", "x.zip", "--minutes", "abc"],
     "argument --minutes: invalid float value: 'abc'"),
] + ([] if _has_cuda() else [
    (["serve", "--no-record", "--device", "cuda"], "no CUDA device is available here"),
])))
def test_input_mistakes_exit_2_with_one_line(args, fragment):
    r = subprocess.run(CLI + args, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert fragment in lines[0] and "Traceback" not in r.stderr


def test_the_log_level_before_snapshot_and_k8s_is_the_global_option(tmp_path):
    # snapshot and k8s parse their own words; the global option in front of them still works
    manifests = subprocess.run(CLI + ["--log-level", "DEBUG", "k8s", "--model", "mlp"],
                               capture_output=True, text=True, timeout=120, env=ENV)
    assert manifests.returncode == 0, manifests.stderr
    assert "kind: Deployment" in manifests.stdout
    missing = subprocess.run(CLI + ["--log-level=info", "snapshot", "export", "--out",
                                    str(tmp_path / "x.zip"), "--db",
                                    f"sqlite:///{tmp_path}/none.db"],
                             capture_output=True, text=True, timeout=120, env=ENV)
    assert missing.returncode == 2 and "there is no SQLite database file" in missing.stderr


def test_incomplete_user_model_shows_the_code_to_write(tmp_path):
    (tmp_path / "half.py").write_text(
        "from runtime.api.model import ModelAPI, TensorSpec\n"
        "class Half(ModelAPI):\n"
        "    name = 'half'\n"
        "    inputs = (TensorSpec('X', 'FP32', (4,)),)\n"
        "    outputs = (TensorSpec('Y', 'FP32', (4,)),)\n"
        "    def decode(self, inputs):\n"
        "        return inputs['X']\n")
    r = subprocess.run(CLI + ["serve", "--no-record", "--model", f"{tmp_path / 'half.py'}:Half"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "is incomplete: Half must implement `collate`" in r.stderr
    assert "def collate(self, items, pad_to):" in r.stderr and "Traceback" not in r.stderr



def test_demo_records_batches_and_stops_on_sigterm(tmp_path):
    url_db = f"sqlite:///{tmp_path / 'demo.db'}"
    # a cache that cannot be written (under a file): the adapters go to a temporary
    # folder, removed when the demo stops
    (tmp_path / "not-a-folder").write_text("")
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "runtime.tools.demo", "--db", url_db, "--port", "0",
                             "--intensity", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "XDG_CACHE_HOME": str(tmp_path / "not-a-folder" / "c"),
                                 "TMPDIR": str(temp)})
    try:
        url = first_url(lines_of(proc))
        db = make_engine(url_db)

        def counts():
            with db.connect() as conn:
                return dict(conn.execute(text(
                    "SELECT model, count(*) FROM requests WHERE outcome='ok' GROUP BY model")).all())

        def adapted():  # answered encoder requests that named one of the demo adapters
            with db.connect() as conn:
                return conn.execute(text(
                    "SELECT count(*) FROM requests WHERE model='encoder' AND outcome='ok' "
                    "AND adapter IS NOT NULL")).scalar()

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (counts().get("mlp", 0) >= 20
                                                   and counts().get("encoder", 0) >= 2
                                                   and adapted() >= 2):
            time.sleep(0.5)
        seen = counts()
        assert seen.get("mlp", 0) >= 20 and seen.get("encoder", 0) >= 2, seen
        assert adapted() >= 2, "no demo request with an adapter was recorded"
        with db.connect() as conn:
            mixed = conn.execute(text("SELECT max(adapters) FROM batches "
                                      "WHERE model='encoder'")).scalar()
        assert mixed is not None and mixed >= 1, mixed
        live = control.live_instances(db, now=time.time())
        assert [i.url for i in live] == [url] and set(live[0].models) == {"mlp", "encoder", "decoder"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert control.all_instances(db)[0].stopped_at is not None
    assert not [p for p in temp.iterdir() if p.name.startswith("batchscope-demo-adapters")]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_demo_traffic_runs_in_a_child_that_ends_with_the_demo_even_on_sigkill(tmp_path):
    url_db = f"sqlite:///{tmp_path / 'demo.db'}"
    temp, cache = tmp_path / "tmp", tmp_path / "cache"
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "runtime.tools.demo", "--db", url_db,
                             "--port", "0", "--intensity", "0.3", "--no-generation"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "TMPDIR": str(temp), "XDG_CACHE_HOME": str(cache)})
    try:
        first_url(lines_of(proc))
        deadline = time.monotonic() + 60
        driver: list[int] = []
        while time.monotonic() < deadline and not driver:
            driver = [c for c in _children(proc.pid) if _alive(c)
                      and "spawn_main" in open(f"/proc/{c}/cmdline").read()]
            time.sleep(0.2)
        assert len(driver) == 1, "the traffic driver process was not found"
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(driver[0]):
            time.sleep(0.2)
        assert not _alive(driver[0]), "the traffic driver outlived the demo"
        # its adapters stay in the user's cache, complete, for the next demo; nothing of
        # them is left in the temporary folder
        adapters = sorted(p.name for p in (cache / "batchscope" / "demo-adapters").glob("*/*"))
        assert adapters == [f"enc-{i}" for i in range(8)], adapters
        assert not [p for p in temp.iterdir() if p.name.startswith("batchscope-demo-adapters")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_a_generation_model_alone():
    import httpx

    with serving(["--model", "decoder", "--port", "0", "--no-record", "--torch-threads", "1"],
                 ENV) as url:
        done = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": "decoder", "prompt": "hi", "max_tokens": 4,
                                "ignore_eos": True})
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200


def test_a_grpc_port_in_use_is_said_in_one_line_exit_2():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(CLI + ["serve", "--no-record", "--model", "mlp", "--port", "0",
                                  "--grpc-port", str(port)],
                           capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # grpc's own core may log a line before it
    assert f"could not listen on 127.0.0.1:{port}" in last and "--grpc-port" in last


@pytest.mark.parametrize("db, shown", [
    ("sqlite:////nonexistent-dir/x.db",
     "there is no SQLite database file at /nonexistent-dir/x.db"),
    ("postgresql+psycopg://tuner:s3cret@127.0.0.1:1/bs?connect_timeout=5",
     "--db postgresql+psycopg://tuner:***@127.0.0.1:1/bs?connect_timeout=5 cannot be used"),
])
def test_tune_refuses_a_database_it_cannot_open_before_tuning(db, shown):
    import httpx

    with serving(["--model", "mlp", "--port", "0", "--no-record", "--torch-threads", "1"],
                 ENV) as url:
        before = httpx.get(f"{url}/v2/models/mlp/batching", timeout=10).json()
        r = subprocess.run(CLI + ["tune", "--url", url, "--model", "mlp", "--slo-p99-ms", "500",
                                  "--budget-s", "2", "--warmup-s", "0", "--db", db],
                           capture_output=True, text=True, timeout=120, env=ENV)
        assert r.returncode == 2, (r.stdout, r.stderr)
        [line] = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert shown in line and "nothing was tuned" in line and "leave out --db" in line
        assert "s3cret" not in r.stderr + r.stdout and "Traceback" not in r.stderr
        assert r.stdout == ""                                     # no session began
        stats = httpx.get(f"{url}/v2/models/mlp/stats", timeout=10).json()
        assert stats["model_stats"][0]["inference_count"] == 0    # no load was sent
        assert httpx.get(f"{url}/v2/models/mlp/batching", timeout=10).json() == before
