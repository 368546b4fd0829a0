"""Triton's trace extension: the settings over HTTP and gRPC, which requests are traced,
and what is recorded for them.

The sampler and the settings are tested as plain objects (``runtime.core.tracing``),
the trace file writer on files of the test's own. A real ``Service`` on 127.0.0.1
(the HTTP/1 server with its inference fast path, the Starlette routes and the gRPC
server, recording into a SQLite file) then shows the settings round trip through
``tritonclient`` (HTTP and gRPC) and what is recorded: every outcome depends on counts
(how many requests were sent, how many traces the tracer began), never on timing; the
database is read once the recorder has written what the counts say it must.
"""

from __future__ import annotations

import json
import os
import tempfile

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from batchscope.storage.records import TraceRow
from batchscope.storage.schema import RequestTraceRecord
from runtime.api.config import ServerConfig
from runtime.api.errors import ClientError
from runtime.core.tracing import (DEFAULTS, KEYS, RequestTrace, TraceControl, TraceSampler,
                                  parse_changes, parse_traceparent, span_ids, span_line,
                                  traceparent_bytes)
from runtime.engine.tracefile import NotATraceFile, TraceFileWriter, append_to_array
from runtime.engine.tracing import COLUMNS, GRPC_NAMES, HTTP_NAMES
from runtime.models.toys import DoubleModel, FailingModel
from runtime.server.fastpath import LARGE_BODY_BYTES
from runtime.server.auth import AuthConfig, Forbidden, Unauthorized, auth_for_listening
from runtime.server.service import Service, ServiceThread
from runtime.tools.cli.serve_args import TraceFlags
from tests.factories import TracedService, wait_until

TIMEOUT_S = 30.0
TOKEN = "trace-token-for-tests-0123456789"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
#: Triton's timestamps of an HTTP request, in the order they happen
HTTP_ORDER = ("recv_start_at", "recv_end_at", "request_start_at", "queue_start_at",
              "compute_start_at", "compute_input_end_at", "compute_output_start_at",
              "compute_end_at", "request_end_at", "send_start_at", "send_end_at")
#: what the global settings are put back to before every server test
RESET = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
         "log_frequency": "0", "trace_file": "", "trace_mode": "triton"}
BODY = {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


# -- the sampler and the settings, as objects ----------------------------------------------
def test_the_sampler_takes_the_first_request_then_one_in_rate():
    sampler = TraceSampler(True, 10, -1)
    taken = [i for i in range(1000) if sampler.sample()]
    assert len(taken) == 100 and taken[:3] == [0, 10, 20]


def test_the_sampler_stops_when_its_count_runs_out():
    sampler = TraceSampler(True, 3, 4)
    taken = [i for i in range(100) if sampler.sample()]
    assert taken == [0, 3, 6, 9] and sampler.left == 0 and not sampler.on


def test_a_sampler_that_is_off_takes_nothing():
    assert not any(TraceSampler(False, 1, -1).sample() for _ in range(10))
    assert not any(TraceSampler(True, 1, 0).sample() for _ in range(10))


def test_tracing_is_off_by_default_and_inactive():
    control = TraceControl(["a", "b"])
    assert not control.active
    assert control.effective() == {"trace_file": "", "trace_level": ["OFF"], "trace_rate": "1000",
                                   "trace_count": "-1", "log_frequency": "0",
                                   "trace_mode": "triton"}
    assert not any(control.sample("a") for _ in range(5000))


def test_rate_ten_traces_exactly_a_tenth():
    control = TraceControl(["a"])
    control.update(None, parse_changes({"trace_rate": "10", "trace_level": ["TIMESTAMPS"]}))
    assert control.active
    assert sum(control.sample("a") for _ in range(1000)) == 100


def test_trace_count_counts_down_and_tracing_stops_at_zero():
    control = TraceControl(["a"])
    doc = control.update(None, parse_changes({"trace_rate": "1", "trace_count": "5",
                                              "trace_level": "TIMESTAMPS"}))
    assert doc["trace_count"] == "5" and doc["trace_level"] == ["TIMESTAMPS"]
    assert sum(control.sample("a") for _ in range(3)) == 3
    assert control.effective()["trace_count"] == "2"
    assert sum(control.sample("a") for _ in range(20)) == 2
    assert control.effective()["trace_count"] == "0" and not control.active
    # a new count starts again
    control.update(None, parse_changes({"trace_count": "1"}))
    assert control.active and sum(control.sample("a") for _ in range(20)) == 1


def test_model_settings_override_the_global_ones_key_by_key_and_null_clears():
    control = TraceControl(["a", "b"])
    control.update(None, parse_changes({"trace_rate": "100", "trace_file": "/tmp/x.json"}))
    doc = control.update("a", parse_changes({"trace_level": ["TIMESTAMPS"], "trace_rate": "2"}))
    assert doc["trace_level"] == ["TIMESTAMPS"] and doc["trace_rate"] == "2"
    assert doc["trace_file"] == "/tmp/x.json"  # not overridden: the global value
    assert control.effective("b")["trace_level"] == ["OFF"]
    assert control.effective()["trace_rate"] == "100"
    assert sum(control.sample("a") for _ in range(10)) == 5
    assert sum(control.sample("b") for _ in range(10)) == 0
    # a global change reaches the keys a model does not set
    control.update(None, parse_changes({"trace_file": "/tmp/y.json", "trace_rate": "7"}))
    assert control.effective("a")["trace_file"] == "/tmp/y.json"
    assert control.effective("a")["trace_rate"] == "2"
    # null clears a model's own value; with none left it follows the global settings
    assert control.update("a", parse_changes({"trace_rate": None}))["trace_rate"] == "7"
    control.update("a", parse_changes({"trace_level": None}))
    assert control.overrides == {} and not control.active
    assert control.effective("a") == control.effective()
    # null on a global key puts the default back
    assert control.update(None, parse_changes({"trace_rate": None}))["trace_rate"] == "1000"


def test_a_model_with_its_own_count_samples_on_its_own():
    control = TraceControl(["a", "b"])
    control.update(None, parse_changes({"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                        "trace_count": "3"}))
    control.update("a", parse_changes({"trace_count": "2"}))
    assert sum(control.sample("a") for _ in range(10)) == 2
    assert sum(control.sample("b") for _ in range(10)) == 3
    assert control.effective("a")["trace_count"] == "0"
    assert control.effective("b")["trace_count"] == "0" and not control.active


def test_a_spent_count_stays_spent_when_a_model_gets_settings_of_its_own():
    """A model's own sampler goes on from the count it stood at: a change of another of
    its settings, or clearing its count, never gives back traces already taken."""
    control = TraceControl(["a", "b"])
    control.update(None, parse_changes({"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                        "trace_count": "2"}))
    assert sum(control.sample("a") for _ in range(5)) == 2
    assert control.update("a", parse_changes({"log_frequency": "0"}))["trace_count"] == "0"
    assert control.update("a", parse_changes({"trace_rate": "2"}))["trace_count"] == "0"
    assert sum(control.sample("a") for _ in range(5)) == 0
    # a count of its own set, then cleared: it goes on from the global count left (0)
    control.update("a", parse_changes({"trace_count": "3"}))
    assert sum(control.sample("a") for _ in range(2)) == 1  # rate 2: the first of two
    assert control.update("a", parse_changes({"trace_count": None}))["trace_count"] == "0"
    assert sum(control.sample("a") for _ in range(5)) == 0
    # a model on the global count mid-way takes over what is left of it
    control.update(None, parse_changes({"trace_count": "4"}))
    assert sum(control.sample("b") for _ in range(1)) == 1
    control.update("b", parse_changes({"trace_rate": "1"}))
    assert control.effective("b")["trace_count"] == "3"
    assert sum(control.sample("b") for _ in range(10)) == 3


@pytest.mark.parametrize("doc, fragment", [
    ({"trace_rat": "10"}, "trace_file, trace_level, trace_rate, trace_count, log_frequency, "
                          "trace_mode"),
    ({"trace_rate": "0"}, "a whole number of at least 1"),
    ({"trace_rate": "ten"}, "a whole number of at least 1"),
    ({"trace_rate": True}, "a whole number of at least 1"),
    ({"trace_count": "-2"}, '"-1" (no limit)'),
    ({"log_frequency": "-1"}, "at least 0"),
    ({"trace_level": ["TENSORS"]}, "TENSORS\" is not supported"),
    ({"trace_level": ["LOUD"]}, '["TIMESTAMPS"] to trace'),
    ({"trace_level": []}, '["TIMESTAMPS"] to trace'),
    ({"trace_level": ["OFF", "TIMESTAMPS"]}, 'send ["OFF"] or ["TIMESTAMPS"]'),
    ({"trace_mode": "jaeger"}, '"triton" or "opentelemetry"'),
    ({"trace_file": 3}, "trace_file=3"),
    ([], "a JSON object of trace settings"),
])
def test_bad_settings_are_refused_saying_the_accepted_form(doc, fragment):
    with pytest.raises(ClientError) as info:
        parse_changes(doc)
    assert info.value.http_status == 400 and fragment in info.value.message


def test_numbers_are_taken_as_well_as_strings_and_levels_as_one_string():
    assert parse_changes({"trace_rate": 5, "trace_count": "-1", "trace_level": "timestamps"}) \
        == {"trace_rate": 5, "trace_count": -1, "trace_level": ("TIMESTAMPS",)}
    assert set(KEYS) == set(DEFAULTS)


def test_traceparent_headers():
    assert parse_traceparent(f"00-{TRACE_ID}-{SPAN_ID}-01") == (TRACE_ID, SPAN_ID, True)
    assert parse_traceparent(f"00-{TRACE_ID}-{SPAN_ID}-00".encode()) == (TRACE_ID, SPAN_ID, False)
    assert parse_traceparent(f"01-{TRACE_ID}-{SPAN_ID}-01-later") == (TRACE_ID, SPAN_ID, True)
    for bad in (None, "", "garbage", f"00-{'0' * 32}-{SPAN_ID}-01", f"00-{TRACE_ID}-{'0' * 16}-01",
                f"ff-{TRACE_ID}-{SPAN_ID}-01", f"00-{TRACE_ID}-{SPAN_ID}-01-more",
                f"00-{TRACE_ID.upper()}-{SPAN_ID}-01"):
        assert parse_traceparent(bad) is None, bad
    span = span_line(int(TRACE_ID, 16), int(SPAN_ID, 16))
    assert traceparent_bytes(span) == f"00-{TRACE_ID}-{SPAN_ID}-01".encode()
    assert span == b"traceparent: " + traceparent_bytes(span) + b"\r\n"
    assert span_ids(span) == (int(TRACE_ID, 16), int(SPAN_ID, 16))
    small = span_line(1, 2)  # ids written at their full width
    assert parse_traceparent(traceparent_bytes(small)) == ("0" * 31 + "1", "0" * 15 + "2", True)
    assert span_ids(small) == (1, 2)


def test_the_items_of_one_request_widen_its_compute_span_and_stay_in_order():
    trace = RequestTrace(1, "a", "http", 10.0)
    trace.ran(10.1, 11.0, 11.2, 11.8, 12.0, 7, 12.1, "ok")
    trace.ran(10.1, 10.5, 10.6, 12.5, 13.0, 8, 13.1, "ok")
    assert (trace.compute_start, trace.compute_end, trace.request_end) == (10.5, 13.0, 13.1)
    assert trace.batch_seq == 7 and trace.outcome == "ok"
    trace.settled(10.1, 13.2, "error")
    assert trace.outcome == "error" and trace.request_end == 13.2
    times = [t for _, t in trace.timeline() if t is not None]
    assert times == sorted(times)


# -- the trace file --------------------------------------------------------------------------
def row(trace_id: int, protocol: str = "http") -> TraceRow:
    return TraceRow("i", "a", trace_id, protocol, "ok", 1.5, 2.5, request_id="r1",
                    queue_start_at=1.75, w3c_trace_id=TRACE_ID, w3c_parent_span_id=SPAN_ID)


def writer() -> TraceFileWriter:
    return TraceFileWriter(list(zip(HTTP_NAMES, COLUMNS)),
                           grpc_names=list(zip(GRPC_NAMES, COLUMNS)))


def test_the_trace_file_probe_creates_removes_and_blocks_on_nothing(tmp_path):
    from runtime.engine.tracefile import check_writable

    new = tmp_path / "new.json"
    assert check_writable(str(new)) is None and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # its probe file went too
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # opened for writing with no reader, a pipe would block the caller
    assert check_writable(str(pipe)) == "it is not a regular file"
    dangling = tmp_path / "link.json"
    dangling.symlink_to(tmp_path / "elsewhere.json")
    assert check_writable(str(dangling)) is None
    assert dangling.is_symlink() and not (tmp_path / "elsewhere.json").exists()
    kept = tmp_path / "kept.json"
    kept.write_bytes(b"[]\n")
    assert check_writable(str(kept)) is None and kept.read_bytes() == b"[]\n"


def test_the_trace_file_is_a_json_array_after_every_write(tmp_path):
    path = str(tmp_path / "trace.json")
    files = writer()
    files.put(path, 0, row(1))
    assert files.flush() == 1
    files.put(path, 0, row(2))
    files.put(path, 0, row(3, "grpc"))
    assert files.flush() == 2
    doc = json.loads(open(path).read())
    assert [t["id"] for t in doc] == [1, 2, 3]
    assert doc[0] == {"id": 1, "model_name": "a", "model_version": 1, "request_id": "r1",
                      "w3c_trace_id": TRACE_ID, "w3c_parent_span_id": SPAN_ID,
                      "timestamps": [{"name": "REQUEST_START", "ns": 1_500_000_000},
                                     {"name": "QUEUE_START", "ns": 1_750_000_000},
                                     {"name": "REQUEST_END", "ns": 2_500_000_000}]}
    assert files.dropped == 0 and files.written == 3
    # an empty request id is left out, as Triton does
    from runtime.engine.tracefile import trace_entry
    blank = TraceRow("i", "a", 4, "http", "ok", 1.5, 2.5, request_id="")
    assert "request_id" not in trace_entry(blank, list(zip(HTTP_NAMES, COLUMNS)))


def test_log_frequency_starts_a_new_indexed_file_every_n_traces(tmp_path):
    path = str(tmp_path / "trace.json")
    files = writer()
    for i in range(1, 6):
        files.put(path, 2, row(i))
    files.flush()
    assert [[t["id"] for t in json.loads(open(f"{path}.{n}").read())] for n in range(3)] == \
        [[1, 2], [3, 4], [5]]
    files.reset(path)  # as a new trace_file does: from .0 again (appended to)
    files.put(path, 2, row(6))
    files.flush()
    assert [t["id"] for t in json.loads(open(f"{path}.0").read())] == [1, 2, 6]


def test_a_file_that_is_not_a_trace_array_is_never_written_over(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me\n")
    with pytest.raises(NotATraceFile):
        append_to_array(str(path), [b"{}"])
    files = writer()
    files.put(str(path), 0, row(1))
    assert files.flush() == 0 and files.dropped == 1
    assert path.read_text() == "keep me\n"


def test_failed_writes_and_a_full_buffer_are_counted_not_raised(tmp_path):
    files = TraceFileWriter(list(zip(HTTP_NAMES, COLUMNS)), max_pending=3)
    missing = str(tmp_path / "no-such-folder" / "trace.json")
    for i in range(5):
        files.put(missing, 0, row(i))
    assert files.dropped == 2  # the buffer holds 3
    assert files.flush() == 0 and files.dropped == 5
    files.close()
    files.put(str(tmp_path / "t.json"), 0, row(9))  # after close: dropped, counted
    assert files.dropped == 6


# -- the gate -----------------------------------------------------------------------------------
def test_a_post_without_content_type_passes_only_on_the_untyped_json_routes():
    auth = AuthConfig()
    assert auth.check("POST", {"host": "127.0.0.1:8000"}, "127.0.0.1", untyped_json=True) \
        == "loopback"
    with pytest.raises(ClientError):
        auth.check("POST", {"host": "127.0.0.1:8000"}, "127.0.0.1")
    with pytest.raises(ClientError):  # a form stays refused
        auth.check("POST", {"host": "127.0.0.1:8000", "content-type": "text/plain"}, "127.0.0.1",
                   untyped_json=True)
    with pytest.raises(Forbidden):  # another site's page, whatever it sends
        auth.check("POST", {"host": "127.0.0.1:8000", "origin": "http://evil.example"},
                   "127.0.0.1", untyped_json=True)


def test_beyond_loopback_the_token_is_required_over_http_and_grpc():
    beyond = auth_for_listening("0.0.0.0", TOKEN)
    assert not beyond.loopback_only
    with pytest.raises(Unauthorized):
        beyond.check("POST", {"content-type": "application/json"}, "10.1.2.3", untyped_json=True)
    with pytest.raises(Unauthorized):
        beyond.check_rpc(None, "10.1.2.3")
    with pytest.raises(Forbidden):
        beyond.check_rpc("Bearer wrong-token-0123456789", "127.0.0.1")
    assert beyond.check_rpc(f"Bearer {TOKEN}", "10.1.2.3") == beyond.identity
    with pytest.raises(Forbidden):  # a server beyond loopback without a token takes none
        AuthConfig(token=None, loopback_only=False).check_rpc(None, "127.0.0.1")
    with pytest.raises(Unauthorized):
        AuthConfig().check_rpc(None, "10.1.2.3")
    assert AuthConfig().check_rpc(None, "::1") == "loopback"


# -- the real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = TracedService(tmp_path_factory.mktemp("trace") / "traces.db",
                      {"a": DoubleModel(), "b": DoubleModel(), "failing": FailingModel()},
                      "trace-test")
    yield s
    s.close()


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=TIMEOUT_S) as client:
        # every test starts from the defaults: tracing OFF, no model settings
        served.reset(client, ("a", "b"), RESET)
        yield client


def send(http: httpx.Client, model: str, n: int, **headers: str) -> None:
    for _ in range(n):
        r = http.post(f"/v2/models/{model}/infer", json=BODY, headers=headers)
        assert r.status_code == 200, r.text


def in_order(trace: TraceRow, columns=HTTP_ORDER) -> bool:
    times = [getattr(trace, c) for c in columns]
    return None not in times and times == sorted(times)


@pytest.mark.slow
def test_rate_ten_then_a_thousand_requests_records_exactly_a_hundred(served, http):
    r = http.post("/v2/trace/setting", json={"trace_rate": "10", "trace_level": ["TIMESTAMPS"]})
    assert r.status_code == 200, r.text
    assert r.json()["trace_rate"] == "10" and r.json()["trace_level"] == ["TIMESTAMPS"]
    before = served.tracer.last_id
    send(http, "a", 1000)
    assert served.tracer.last_id - before == 100
    rows = served.rows(before, 100)
    assert len(rows) == 100
    assert [t.trace_id for t in rows] == list(range(before + 1, before + 101))
    for trace in rows:
        assert trace.model == "a" and trace.protocol == "http" and trace.outcome == "ok"
        assert trace.batch_seq is not None and trace.w3c_trace_id is None
        assert in_order(trace), trace
    assert b'batchscope_traced_requests_total{model="a",protocol="http"}' in \
        http.get("/metrics").content


@pytest.mark.slow
def test_each_traced_answer_names_the_batch_its_row_and_the_batch_table_have(served, http):
    http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    before, traced = served.tracer.last_id, served.tracer.traced
    named = []
    for i in range(6):
        r = http.post("/v2/models/a/infer", json={"id": f"n{i}", **BODY})
        assert r.status_code == 200, r.text
        named.append((f"n{i}", int(r.headers["batchscope-batch-id"])))
    rows = served.rows(before, 6)
    assert [(t.request_id, t.batch_seq) for t in rows] == named
    assert all(in_order(t) and t.outcome == "ok" for t in rows)
    assert served.tracer.traced - traced == 6
    seqs = {seq for _, seq in named}

    def batch_rows() -> set[int]:
        with served.db.connect() as conn:
            return {seq for (seq,) in conn.exec_driver_sql(
                "SELECT seq FROM batches WHERE model = 'a' AND seq BETWEEN ? AND ?",
                (min(seqs), max(seqs))).all()}

    assert wait_until(lambda: seqs <= batch_rows(), limit=4000), (seqs, batch_rows())


@pytest.mark.slow
def test_tracing_off_records_nothing(served, http):
    before, traced = served.tracer.last_id, served.tracer.traced
    send(http, "a", 50)
    send(http, "b", 50, traceparent=f"00-{TRACE_ID}-{SPAN_ID}-00")  # not marked sampled
    assert (served.tracer.last_id, served.tracer.traced) == (before, traced)
    assert http.get("/v2/trace/setting").json() == RESET


@pytest.mark.slow
def test_trace_count_stops_at_its_number(served, http):
    r = http.post("/v2/trace/setting", json={"trace_rate": "1", "trace_count": "5",
                                              "trace_level": ["TIMESTAMPS"]})
    assert r.json()["trace_count"] == "5"
    before = served.tracer.last_id
    send(http, "a", 3)
    assert http.get("/v2/trace/setting").json()["trace_count"] == "2"
    send(http, "b", 10)
    assert served.tracer.last_id - before == 5
    assert http.get("/v2/trace/setting").json()["trace_count"] == "0"
    rows = served.rows(before, 5)
    assert [t.model for t in rows] == ["a"] * 3 + ["b"] * 2


@pytest.mark.slow
def test_model_settings_override_the_global_ones(served, http):
    r = http.post("/v2/models/a/trace/setting", json={"trace_level": ["TIMESTAMPS"],
                                                      "trace_rate": "2"})
    assert r.status_code == 200, r.text
    assert r.json()["trace_level"] == ["TIMESTAMPS"] and r.json()["trace_rate"] == "2"
    assert http.get("/v2/models/b/trace/setting").json() == RESET
    assert http.get("/v2/trace/setting").json() == RESET
    before = served.tracer.last_id
    send(http, "a", 10)
    send(http, "b", 10)
    assert served.tracer.last_id - before == 5
    assert {t.model for t in served.rows(before, 5)} == {"a"}
    # the global level applies to b; a keeps its own rate
    http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "5"})
    assert http.get("/v2/models/a/trace/setting").json()["trace_rate"] == "2"
    before = served.tracer.last_id
    send(http, "b", 10)
    assert served.tracer.last_id - before == 2
    # null clears a's own values: it follows the global settings again
    r = http.post("/v2/models/a/trace/setting", json={"trace_level": None, "trace_rate": None})
    assert r.json()["trace_rate"] == "5"
    assert http.get("/v2/models/a/trace/setting").json() == \
        http.get("/v2/trace/setting").json()


@pytest.mark.slow
def test_unknown_keys_bad_values_and_unknown_models_are_refused(http):
    r = http.post("/v2/trace/setting", json={"trace_rat": "10"})
    assert r.status_code == 400
    assert "trace_level" in r.json()["error"] and "log_frequency" in r.json()["error"]
    r = http.post("/v2/trace/setting", json={"trace_rate": "-3"})
    assert r.status_code == 400 and "at least 1" in r.json()["error"]
    r = http.post("/v2/trace/setting", json={"trace_level": ["TENSORS"]})
    assert r.status_code == 400 and "TIMESTAMPS" in r.json()["error"]
    r = http.post("/v2/trace/setting", content=b"{not json",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    r = http.post("/v2/trace/setting", json={"trace_file": "/no/such/folder/t.json"})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]
    r = http.post("/v2/trace/setting", json={"trace_file": "/dev/null/t.json"})
    assert r.status_code == 400 and "'/dev/null' is not a folder" in r.json()["error"], r.text
    # a file the server cannot make: refused now, not every trace dropped later
    for unwritable in ("/proc/t.json", f"{tempfile.gettempdir()}/{'n' * 300}.json"):
        r = http.post("/v2/trace/setting", json={"trace_file": unwritable})
        assert r.status_code == 400 and "cannot write" in r.json()["error"], r.text
    assert http.get("/v2/models/nope/trace/setting").status_code == 404
    assert http.post("/v2/models/nope/trace/setting", json={}).status_code == 404
    # a page of another site cannot change them; a form post is not JSON
    r = http.post("/v2/trace/setting", json={"trace_rate": "1"},
                  headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = http.post("/v2/trace/setting", content=b'{"trace_rate": "1"}',
                  headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert http.get("/v2/trace/setting").json() == RESET  # nothing changed


@pytest.mark.slow
def test_tritonclient_http_round_trip(served, http):
    client = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
    try:
        assert "trace" in client.get_server_metadata()["extensions"]
        assert client.get_trace_settings() == RESET
        doc = client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"],
                                                     "trace_rate": "3"})
        assert doc["trace_level"] == ["TIMESTAMPS"] and doc["trace_rate"] == "3"
        doc = client.update_trace_settings(model_name="b", settings={"trace_count": "4"})
        assert doc["trace_count"] == "4" and doc["trace_rate"] == "3"
        assert client.get_trace_settings(model_name="b")["trace_count"] == "4"
        assert client.update_trace_settings(model_name="b", settings={"trace_count": None}) \
            == client.get_trace_settings()
        with pytest.raises(InferenceServerException, match="trace_rate"):
            client.update_trace_settings(settings={"trace_rat": "1"})
    finally:
        client.close()


@pytest.mark.slow
def test_tritonclient_grpc_round_trip_and_grpc_requests_are_traced(served, http):
    client = grpcclient.InferenceServerClient(served.grpc_address)
    try:
        assert "trace" in client.get_server_metadata(as_json=True)["extensions"]
        got = client.get_trace_settings(as_json=True)["settings"]
        assert {k: v["value"] for k, v in got.items()} == {
            k: v if isinstance(v, list) else [v] for k, v in RESET.items()}
        doc = client.update_trace_settings(model_name="a", settings={
            "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "2"}, as_json=True)
        assert doc["settings"]["trace_count"]["value"] == ["2"]
        assert http.get("/v2/models/a/trace/setting").json()["trace_level"] == ["TIMESTAMPS"]
        before = served.tracer.last_id
        x = grpcclient.InferInput("INPUT0", [4], "FP32")
        x.set_data_from_numpy(np.arange(4, dtype=np.float32))
        for i in range(3):
            client.infer("a", [x], request_id=f"req-{i}")
        assert served.tracer.last_id - before == 2
        rows = served.rows(before, 2)
        assert [(t.protocol, t.request_id) for t in rows] == [("grpc", "req-0"), ("grpc", "req-1")]
        for trace in rows:
            # the handler is given the request already read: no receive start; its send
            # end is stamped once the call has ended (its answer and status sent)
            assert trace.recv_start_at is None and trace.send_end_at is not None
            assert in_order(trace, HTTP_ORDER[1:])
            # Triton's trace_summary.py counts a gRPC trace only with GRPC_WAITREAD_START
            # and GRPC_SEND_END: the file gives the start equal to GRPC_WAITREAD_END
            from runtime.engine.tracefile import trace_entry
            names = [t["name"] for t in
                     trace_entry(trace, list(zip(GRPC_NAMES, COLUMNS)))["timestamps"]]
            assert names[:2] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END"]
            assert names[-2:] == ["GRPC_SEND_START", "GRPC_SEND_END"]
        # an empty value clears the model's own setting
        doc = client.update_trace_settings(model_name="a", settings={
            "trace_level": None, "trace_rate": None, "trace_count": None}, as_json=True)
        assert doc["settings"]["trace_level"]["value"] == ["OFF"]
        with pytest.raises(InferenceServerException, match="trace_file, trace_level"):
            client.update_trace_settings(settings={"trace_rat": "1"})
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.get_trace_settings(model_name="nope")
    finally:
        client.close()


def test_a_traced_grpc_answer_names_its_batch_in_its_metadata(served, http):
    """As a traced HTTP answer's ``batchscope-batch-id`` header: the batch it ran in, the
    one its trace row names. An untraced answer carries none."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="a")
    item = request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    item.contents.fp32_contents.extend([1, 2, 3, 4])
    with grpc.insecure_channel(served.grpc_address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        _, call = infer.with_call(request, timeout=TIMEOUT_S)
        assert "batchscope-batch-id" not in dict(call.initial_metadata())
        http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        before = served.tracer.last_id
        _, call = infer.with_call(request, timeout=TIMEOUT_S)
    [row] = served.rows(before, 1)
    assert dict(call.initial_metadata())["batchscope-batch-id"] == str(row.batch_seq)


@pytest.mark.slow
def test_a_sampled_traceparent_is_always_recorded_with_its_ids(served, http):
    before = served.tracer.last_id
    send(http, "b", 1, traceparent=f"00-{TRACE_ID}-{SPAN_ID}-01")
    [trace] = served.rows(before, 1)
    assert (trace.w3c_trace_id, trace.w3c_parent_span_id) == (TRACE_ID, SPAN_ID)
    assert in_order(trace)
    # with tracing on, one the settings sample keeps its ids too; a sampled one does not
    # count against trace_count
    http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                         "trace_count": "1"})
    before = served.tracer.last_id
    send(http, "b", 2, traceparent=f"00-{TRACE_ID}-{SPAN_ID}-01")
    assert http.get("/v2/trace/setting").json()["trace_count"] == "1"
    send(http, "b", 2, traceparent=f"00-{TRACE_ID}-{SPAN_ID}-00")
    assert served.tracer.last_id - before == 3
    assert [t.w3c_trace_id for t in served.rows(before, 3)] == [TRACE_ID] * 3


@pytest.mark.slow
def test_failed_and_refused_requests_are_traced_with_their_outcome(served, http):
    http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    before = served.tracer.last_id
    r = http.post("/v2/models/failing/infer", json={"inputs": [
        {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [-1, 2, 3, 4]}]})
    assert r.status_code == 500
    r = http.post("/v2/models/a/infer", json={"inputs": [
        {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2]}]})
    assert r.status_code == 400  # refused while decoding: never handed to the engine
    assert served.tracer.last_id - before == 1
    [trace] = served.rows(before, 1)
    assert trace.model == "failing" and trace.outcome == "error"
    assert trace.compute_start_at is not None and trace.batch_seq is not None
    assert trace.request_start_at <= trace.queue_start_at <= trace.compute_start_at \
        <= trace.request_end_at <= trace.send_start_at <= trace.send_end_at


@pytest.mark.slow
def test_a_request_of_several_items_is_one_trace(served, http):
    http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    before = served.tracer.last_id
    r = http.post("/v2/models/a/infer", json={"id": "batch-of-3", "inputs": [
        {"name": "INPUT0", "shape": [3, 4], "datatype": "FP32", "data": list(range(12))}]})
    assert r.status_code == 200, r.text
    [trace] = served.rows(before, 1)
    assert trace.request_id == "batch-of-3" and in_order(trace)


def test_a_large_body_parsed_off_the_loop_is_traced_with_its_receive_times(served, http):
    http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    before = served.tracer.last_id
    # past the size the fast path parses on its parser thread: the connection reads on
    # meanwhile, so the request's receive times are kept before it goes there
    body = orjson.dumps({"id": "large", **BODY}) + b" " * (LARGE_BODY_BYTES + 1)
    r = http.post("/v2/models/a/infer", content=body,
                  headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    [trace] = served.rows(before, 1)
    assert trace.request_id == "large" and in_order(trace), trace


@pytest.mark.slow
def test_the_trace_file_holds_the_traces_in_tritons_format(served, http, tmp_path):
    path = tmp_path / "trace.json"
    r = http.post("/v2/models/b/trace/setting", json={"trace_level": ["TIMESTAMPS"],
                                                      "trace_rate": "1",
                                                      "trace_file": str(path)})
    assert r.status_code == 200, r.text
    before = served.tracer.last_id
    send(http, "b", 4)
    assert served.tracer.last_id - before == 4

    def traces() -> list:
        try:
            return orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return []

    assert wait_until(lambda: len(traces()) == 4, limit=4000)
    doc = traces()
    assert [t["id"] for t in doc] == list(range(before + 1, before + 5))
    for t in doc:
        assert t["model_name"] == "b" and t["model_version"] == 1
        names = [s["name"] for s in t["timestamps"]]
        assert names == list(HTTP_NAMES)
        ns = [s["ns"] for s in t["timestamps"]]
        assert ns == sorted(ns)


@pytest.fixture(scope="module")
def guarded():
    service = Service({"a": DoubleModel()}, None, ServerConfig(record=False, grpc_port=0),
                      instance_id="trace-token", auth=auth_for_listening("0.0.0.0", TOKEN))
    runner = ServiceThread(service)
    runner.start()
    yield runner, service
    runner.stop()


@pytest.mark.slow
def test_a_server_with_a_token_wants_it_for_changes_over_http_and_grpc(guarded):
    runner, service = guarded
    with httpx.Client(base_url=runner.url, timeout=TIMEOUT_S) as http:
        change = {"trace_rate": "7"}
        r = http.post("/v2/trace/setting", json=change)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        r = http.post("/v2/models/a/trace/setting", json=change,
                      headers={"Authorization": "Bearer not-the-token-0123456789"})
        assert r.status_code == 403
        assert http.get("/v2/trace/setting").json()["trace_rate"] == "1000"  # reads need none
        client = httpclient.InferenceServerClient(runner.url.removeprefix("http://"))
        try:
            doc = client.update_trace_settings(settings=change,
                                               headers={"Authorization": f"Bearer {TOKEN}"})
            assert doc["trace_rate"] == "7"
        finally:
            client.close()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{service.grpc_port}")
    try:
        with pytest.raises(InferenceServerException, match="control token"):
            client.update_trace_settings(settings={"trace_rate": "9"})
        assert client.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["7"]
        doc = client.update_trace_settings(settings={"trace_rate": "9"}, as_json=True,
                                           headers={"authorization": f"Bearer {TOKEN}"})
        assert doc["settings"]["trace_rate"]["value"] == ["9"]
    finally:
        client.close()


def test_the_trace_row_has_every_column_of_the_table():
    columns = {c.name for c in RequestTraceRecord.__table__.columns}
    assert set(TraceRow.__slots__) == columns - {"id"}
    assert set(COLUMNS) < set(TraceRow.__slots__)


def test_start_up_trace_config_takes_triton_short_keys_and_refuses_bad_ones():
    from runtime.core.tracing import config_changes
    from runtime.tools.cli import UsageError, trace_config
    assert config_changes([("level", "TIMESTAMPS"), ("rate", "10"), ("log_frequency", "5"),
                           ("trace_mode", "opentelemetry")]) == {
        "trace_level": ("TIMESTAMPS",), "trace_rate": 10, "log_frequency": 5,
        "trace_mode": "opentelemetry"}
    assert trace_config(["rate=100", "level=TIMESTAMPS"], environ={}).pairs == (
        ("trace_rate", "100"), ("trace_level", "TIMESTAMPS"))
    for bad, words in (("rate", "give KEY=VALUE"),
                       ("rate=zero", "trace_rate='zero' is not accepted; it takes a whole"),
                       ("colour=red", "unknown trace setting 'colour'; the forms: level="),
                       ("jaeger,url=x", "triton,KEY=VALUE or opentelemetry,KEY=VALUE"),
                       ("triton,rate=5", "unknown triton trace setting 'rate'"),
                       ("opentelemetry,colour=red", "unknown OpenTelemetry setting"),
                       ("opentelemetry,resource=x", "give resource=KEY=VALUE")):
        with pytest.raises(UsageError, match=words):
            trace_config([bad], environ={})
    # spans need somewhere to go: the mode is refused without an OTLP endpoint
    with pytest.raises(UsageError, match="give --otlp-traces-endpoint URL"):
        trace_config(["mode=opentelemetry"], environ={})
    assert trace_config(["mode=OpenTelemetry"], "http://127.0.0.1:4317", environ={}) == \
        TraceFlags((("trace_mode", "OpenTelemetry"),), "http://127.0.0.1:4317", {})


def test_start_up_trace_config_takes_triton_s_mode_settings():
    """Triton's ``triton,KEY=VALUE`` and ``opentelemetry,KEY=VALUE`` forms, as its own
    ``--trace-config`` takes them: the trace file and its log frequency; the OTLP/HTTP
    endpoint (Triton's exporter's protocol, unless the standard variable names one), a
    resource attribute and the batch span processor's settings as the variables the SDK
    reads."""
    from runtime.tools.cli import UsageError, trace_config

    got = trace_config(["triton,file=/tmp/t.json", "triton,log-frequency=50", "mode=triton",
                        "opentelemetry,url=http://127.0.0.1:4318/v1/traces",
                        "opentelemetry,resource=deployment.environment=test",
                        "opentelemetry,bsp_max_queue_size=4096",
                        "opentelemetry,bsp_schedule_delay=500",
                        "opentelemetry,bsp_max_export_batch_size=256"],
                       environ={"OTEL_RESOURCE_ATTRIBUTES": "team=ml"})
    assert got.pairs == (("trace_file", "/tmp/t.json"), ("log_frequency", "50"),
                         ("trace_mode", "triton"))
    assert got.otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert got.environ == {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                           "OTEL_RESOURCE_ATTRIBUTES": "team=ml,deployment.environment=test",
                           "OTEL_BSP_MAX_QUEUE_SIZE": "4096",
                           "OTEL_BSP_SCHEDULE_DELAY": "500",
                           "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "256"}
    # a protocol the environment names is kept; the url is the mode's endpoint
    grpc = trace_config(["opentelemetry,url=http://127.0.0.1:4317", "mode=opentelemetry"],
                        environ={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    assert grpc.otlp_endpoint == "http://127.0.0.1:4317" and grpc.environ == {}
    with pytest.raises(UsageError, match="name two endpoints"):
        trace_config(["opentelemetry,url=http://127.0.0.1:4318"], "http://127.0.0.1:4317",
                     environ={})
    with pytest.raises(UsageError, match="log_frequency='-1' is not accepted; it takes a whole"):
        trace_config(["triton,log-frequency=-1"], environ={})


def test_a_service_without_an_endpoint_refuses_opentelemetry_at_start(tmp_path):
    from runtime.api.config import ServerConfig
    from runtime.api.errors import ConfigError
    from runtime.server.service import Service

    config = ServerConfig(database_url=None, trace_config=(("mode", "opentelemetry"),))
    with pytest.raises(ConfigError, match="--trace-config: trace_mode \"opentelemetry\""):
        Service({"m": DoubleModel()}, None, config)
