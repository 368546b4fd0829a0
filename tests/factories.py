"""Factories and helpers shared by test modules (fixtures are in ``conftest.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import queue
import subprocess
import threading
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from batchscope.storage.records import BatchRow, GenStepRow, RequestRow

#: the longest a test waits for a child process or a server to do something
WAIT_S = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- traces as written ----------------------------------------------------------------------
def trace_rows_written(db, after: int, expected: int) -> list:
    """The ``request_traces`` rows (``TraceRow``s) numbered after ``after``, oldest first,
    once ``expected`` of them are written (bounded wait)."""
    from batchscope.storage.records import TraceRow
    from batchscope.storage.schema import RequestTraceRecord

    names = TraceRow.__slots__

    def read() -> list:
        with db.connect() as conn:
            found = conn.execute(
                select(*[getattr(RequestTraceRecord, n) for n in names])
                .where(RequestTraceRecord.trace_id > after)
                .order_by(RequestTraceRecord.trace_id)).all()
        return [TraceRow(**dict(zip(names, r))) for r in found]

    assert wait_until(lambda: len(read()) >= expected, limit=4000), \
        f"fewer than {expected} traces were written"
    return read()


def recorded_sqlite(path: Path, end_s: float, *, batches_per_s: float,
                    duration_s: float = 10.0) -> str:
    """The URL of a SQLite file at ``path`` holding ``duration_s`` of one instance
    (``synthetic-1``) serving ``mlp`` at ``batches_per_s``, ending at ``end_s``."""
    from batchscope.storage.db import make_engine
    from batchscope.testing import synthetic

    url = f"sqlite:///{path}"
    engine = make_engine(url)
    synthetic.generate(engine, synthetic.SCENARIOS["healthy"].with_(
        duration_s=duration_s, batches_per_s=batches_per_s), end_s=end_s)
    engine.dispose()
    return url


class TracedService:
    """A real ``Service`` on 127.0.0.1 (HTTP and gRPC, a free port each) recording into the
    SQLite file ``db_path``, for the trace tests: its ``url``, ``grpc_address``, database
    engine ``db`` and ``tracer``. ``close`` stops it."""

    def __init__(self, db_path: Path, models: dict, instance_id: str,
                 generation: dict | None = None) -> None:
        from batchscope.storage.db import make_engine
        from runtime.api.config import ServerConfig
        from runtime.server.service import Service, ServiceThread

        url = f"sqlite:///{db_path}"
        self.service = Service(models, None,
                               ServerConfig(database_url=url, grpc_port=0,
                                            heartbeat_interval_s=0.2,
                                            control_poll_interval_s=0.05),
                               generation=generation, instance_id=instance_id)
        self.runner = ServiceThread(self.service)
        self.url = self.runner.start()
        self.grpc_address = f"127.0.0.1:{self.service.grpc_port}"
        self.db = make_engine(url)
        self.tracer = self.service.engine.tracer

    def rows(self, after: int, expected: int) -> list:
        """The traces numbered after ``after``, once the ``expected`` ones are written."""
        return trace_rows_written(self.db, after, expected)

    def reset(self, client: Any, models: tuple[str, ...], settings: dict) -> None:
        """Put the trace ``settings`` back over ``client`` (an ``httpx.Client`` of ``url``)
        and clear the own values of ``models``."""
        assert client.post("/v2/trace/setting", json=settings).status_code == 200
        for model in models:
            r = client.post(f"/v2/models/{model}/trace/setting",
                            json={key: None for key in settings})
            assert r.status_code == 200, r.text

    def close(self) -> None:
        self.runner.stop()
        self.db.dispose()


# -- waiting, always bounded -------------------------------------------------------------
def wait_until(predicate, limit: int = 2000, interval_s: float = 0.005) -> bool:
    """Poll ``predicate`` up to ``limit`` times; its last value (truthy when reached)."""
    for _ in range(limit):
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


async def wait_for(check, what: str, timeout_s: float = WAIT_S) -> None:
    """On a running loop: poll ``check`` until true, or fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- the database ------------------------------------------------------------------------
def count(db, table) -> int:
    """Rows in ``table`` (a schema class)."""
    with db.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def stored(db, table, cls) -> list:
    """Every row of ``table`` read back as ``cls`` records (a slotted row type), in id order."""
    names = cls.__slots__
    with db.connect() as conn:
        rows = conn.execute(select(*[getattr(table, n) for n in names]).order_by(table.id)).all()
    return [cls(**dict(zip(names, row))) for row in rows]


# -- records for Prometheus tests ----------------------------------------------------------
def gen_step(at: float, *, running: int = 4, prefill: int = 0, drafted: int | None = None,
             accepted: int | None = None, step_s: float = 0.01, model: str = "decoder") -> GenStepRow:
    """A continuous-batching step at ``at``: ``running`` sequences decoding, ``prefill``
    prompt tokens, ``drafted``/``accepted`` proposed tokens (None: no speculation set up)."""
    return GenStepRow("rt", model, at, "continuous", running, 0, prefill, running + (drafted or 0),
                      10, 50, 0, step_s, spec_draft_tokens=drafted, spec_accepted_tokens=accepted)


def metric_batch(model: str, size: int, compute_s: float) -> BatchRow:
    return BatchRow(instance_id="i", model=model, seq=1, policy="dynamic", settings_version=1,
                    max_batch_size=32, bucket=None, batch_size=size, real_elements=size,
                    padded_elements=size, queue_wait_min_s=0.0, queue_wait_mean_s=0.0,
                    queue_wait_max_s=0.0, compute_s=compute_s, started_at=0.0, ended_at=1.0)


def metric_request(model: str, outcome: str, priority: int = 1, latency_s: float = 0.01) -> RequestRow:
    return RequestRow(instance_id="i", model=model, batch_seq=1, priority=priority, arrived_at=0.0,
                      finished_at=latency_s, queue_wait_s=0.002, latency_s=latency_s,
                      outcome=outcome)


def samples(metrics) -> dict:
    """{(sample name, sorted labels): value} of a ``MetricsRecorder``'s rendered text."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- model sources for the device process (loaded from a file path in the child) ------------
#: a model file: x + 1, each batch taking 20 ms of device time whatever its size
SLEEPY_MODEL = '''
import time
import numpy as np
import torch
from runtime.api.model import ModelAPI, TensorSpec


class Sleepy(ModelAPI):
    """x + 1, each batch taking 20 ms whatever its size."""
    name = "sleepy"
    inputs = (TensorSpec("X", "FP32", (4,)),)
    outputs = (TensorSpec("Y", "FP32", (4,)),)

    def decode(self, inputs):
        return np.asarray(inputs["X"], dtype=np.float32).reshape(4)

    def collate(self, items, pad_to):
        return torch.from_numpy(np.stack(items))

    def predict(self, batch):
        time.sleep(0.02)
        return batch + 1

    def split(self, output, n):
        out = output.numpy()
        return [{"Y": out[i]} for i in range(n)]
'''

SLOW_MODEL = '''
import time
from typing import Any
import numpy as np
import torch
from runtime.api.model import ModelAPI, TensorSpec


class SlowModel(ModelAPI):
    """x + 1; an item whose first value is 99 makes predict sleep (up to 30 s)."""
    name = "slow"
    inputs = (TensorSpec("INPUT0", "FP32", (2,)),)
    outputs = (TensorSpec("OUTPUT0", "FP32", (2,)),)

    def decode(self, inputs):
        return np.asarray(inputs["INPUT0"], dtype=np.float32).reshape(2)

    def collate(self, items, pad_to):
        return torch.from_numpy(np.stack(items))

    def predict(self, batch):
        if bool((batch[:, 0] == 99).any()):
            time.sleep(30)
        return batch + 1

    def split(self, output, n):
        out = output.numpy()
        return [{"OUTPUT0": out[i]} for i in range(n)]
'''


# -- raw HTTP/1.1 on a socket ---------------------------------------------------------------
def request(method: str, path: str, body: bytes = b"", *, version: str = "1.1",
            headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: 127.0.0.1"]
    all_headers = dict(headers or {})
    if body and "Transfer-Encoding" not in all_headers:
        all_headers.setdefault("Content-Length", str(len(body)))
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Reader:
    """Reads whole HTTP/1.1 responses from a raw socket (every read bounded by the socket's
    timeout): Content-Length, chunked, or delimited by close."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:  # a server that closes after refusing may reset
            data = b""
        self.buf += data
        return bool(data)

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not self._fill():
                raise ConnectionError(f"closed before {marker!r}; got {self.buf!r}")
        head, self.buf = self.buf.split(marker, 1)
        return head

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("closed mid-body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        head = self._until(b"\r\n\r\n").decode("latin-1")
        status_line, *lines = head.split("\r\n")
        status = int(status_line.split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
        if head_only or status == 100:
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, self._exactly(int(headers["content-length"]))
        if headers.get("transfer-encoding") == "chunked":
            parts = []
            while True:
                size = int(self._until(b"\r\n"), 16)
                if size == 0:
                    self._until(b"\r\n")
                    return status, headers, b"".join(parts)
                parts.append(self._exactly(size))
                self._exactly(2)
        while self._fill():  # delimited by close
            pass
        out, self.buf = self.buf, b""
        return status, headers, out

    def closed(self) -> bool:
        """True when the server closed the connection (and sent nothing more)."""
        return not self.buf and not self._fill()


class RecordingTransport:
    """The parts of ``asyncio.Transport`` a connection uses; records reading and writes."""

    def __init__(self) -> None:
        self.written = b""
        self.paused = False
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


# -- the Streamlit app under AppTest (the ``app_db`` fixture gives it a database) ----------
APP = str(Path(__file__).resolve().parent.parent / "app.py")
PAGES = "batchscope/dashboard/pages"


def run_app(page: str | None = None) -> Any:
    """The app after its first run, on the Live page or on ``page`` ("tuning", ...)."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    if page is not None:
        at.switch_page(f"{PAGES}/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
    return at


# -- a `batchscope serve` child ---------------------------------------------------------
def lines_of(proc: subprocess.Popen) -> queue.Queue:
    out: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def first_url(out: queue.Queue, timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = out.get(timeout=1.0)
        except queue.Empty:
            continue
        if " on http://" in line:
            return line.split(" on ", 1)[1].split()[0]
        seen.append(line)
    raise AssertionError("the server never printed its URL; it printed:\n" + "".join(seen[-40:]))


@contextlib.contextmanager
def serving(args: list[str], env: dict | None = None) -> Iterator[str]:
    """``batchscope serve ARGS`` in a child; yields its URL once it listens. On leaving,
    the child gets SIGTERM and must exit 0 (killed if it has not within the wait)."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime.tools.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield first_url(lines_of(proc))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- databases written by an older release -------------------------------------------------
def database_at(url: str, revision: str, *statements: str) -> None:
    """A database as the migrations up to ``revision`` left it (a release of that schema),
    holding the rows ``statements`` insert (as that release wrote them)."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from batchscope.storage.migrations import SCRIPT_LOCATION

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            config = Config()
            config.set_main_option("script_location", SCRIPT_LOCATION)
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
            for statement in statements:
                if statement.strip():
                    conn.exec_driver_sql(statement)
    finally:
        engine.dispose()
