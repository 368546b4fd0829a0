"""Hostile and careless clients of the trace surfaces of a real server: every mistake gets
a short, clear 4xx (or a 503 for the server's own trouble) with a JSON ``error``, changes
nothing, and the server goes on serving.

One ``Service`` on 127.0.0.1 (the HTTP/1 server with its inference fast path, the
Starlette routes, the gRPC server, a tiny decoder as the generation model ``decoder``)
records into a SQLite file. Outcomes depend on what was sent and on counts (the traces the
tracer began), never on timing.
"""

from __future__ import annotations

import json
import os
import tempfile

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from runtime.models.decoder import TinyDecoder
from runtime.models.toys import DoubleModel
from tests.factories import TracedService, trace_rows_written

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
RESET = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
         "log_frequency": "0", "trace_file": "", "trace_mode": "triton"}
BODY = {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
#: the longest answer a refusal needs: what was wrong and what to send instead
SHORT = 1000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = TracedService(tmp_path_factory.mktemp("hostile") / "hostile.db",
                      {"a": DoubleModel()}, "trace-hostile",
                      generation={"decoder": TinyDecoder(d_model=16, n_layers=1)})
    yield s
    s.close()


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=TIMEOUT_S) as client:
        served.reset(client, ("a", "decoder"), RESET)
        yield client
        # whatever a test did, the server still answers inference
        r = client.post("/v2/models/a/infer", json=BODY)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]


@pytest.fixture
def stub(served):
    channel = grpc.insecure_channel(served.grpc_address)
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def refused(r: httpx.Response, status: int = 400) -> str:
    """The error of a short JSON refusal with ``status``."""
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    assert len(r.content) < SHORT, len(r.content)
    return r.json()["error"]


def grpc_settings(stub, model: str = "", **settings: list[str]) -> dict[str, list[str]]:
    request = pb.TraceSettingRequest(model_name=model)
    for key, values in settings.items():
        request.settings[key].value.extend(values)
    reply = stub.TraceSetting(request, timeout=TIMEOUT_S)
    return {key: list(value.value) for key, value in reply.settings.items()}


# -- the settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("body, words", [
    # nested deeper than Python's repr goes: was a 500 (RecursionError quoting it back)
    ('{"trace_level": ' + "[" * 1000 + "]" * 1000 + "}", "trace_level="),
    ('{"trace_rate": ' + "[" * 990 + '"1"' + "]" * 990 + "}", "trace_rate="),
    # a key twice: which one counts was the parser's choice
    ('{"trace_rate": "1", "trace_rate": "2"}', "more than once"),
    # huge lists and many keys: was a 2 MB echo of the body
    (json.dumps({"trace_level": ["OFF", "TIMESTAMPS"] + ["OFF"] * 200_000}), '"OFF" and'),
    (json.dumps({f"k{i}": 1 for i in range(100_000)}), "and 99990 more"),
    # not level or mode names, though str.upper/str.lower make them look like one
    ('{"trace_level": ["t\\u0131mestamps"]}', "trace_level="),
    ('{"trace_level": "TIME\\u017fTAMPS"}', "trace_level="),
    # already refused well: wrong types and forms of every kind
    ('{"trace_rate": "1e400"}', "whole number"),
    ('{"trace_rate": "\\u0661\\u0660"}', "whole number"),
    ('{"trace_count": "18446744073709551616"}', "whole number"),
    ('{"log_frequency": 1.5}', "whole number"),
    ('{"trace_rate": true}', "whole number"),
    ('{"trace_rate": {"a": 1}}', "whole number"),
    ('{"trace_rate": ["1", "2"]}', "whole number"),
    ('{"trace_level": []}', "TIMESTAMPS"),
    ('{"trace_level": ["TIMESTAMPS", 1]}', "TIMESTAMPS"),
    ('{"trace_mode": "jaeger"}', "opentelemetry"),
    ('{"trace_file": 3}', "trace_file=3"),
    ('{"trace_file": "/tmp/a\\u0000b"}', "trace_file="),
    ("[]", "JSON object"),
    ("null", "JSON object"),
    ('{"trace_rate": "1"', "JSON object"),
    (b'{"trace_rate": "\xff"}', "JSON object"),
    # what was wrong was not said: the body is an object, but not one this server reads
    (b'{"trace_rate": "\xff"}', "not valid UTF-8"),
    ('{"trace_rate": "6"}'.encode("utf-16"), "not valid UTF-8"),
    ('{"trace_rate": ' + "[" * 100_000 + "]" * 100_000 + "}", "depth limit exceeded"),
    ('{"trace_rate": ' + "1" * 4400 + "}", "number is infinity"),
])
def test_a_bad_body_gets_a_short_400_and_changes_nothing(http, body, words):
    r = http.post("/v2/trace/setting", content=body,
                  headers={"Content-Type": "application/json"})
    assert words in refused(r)
    assert http.get("/v2/trace/setting").json() == RESET


def test_a_body_that_starts_with_a_byte_order_mark_is_read(http):
    r = http.post("/v2/trace/setting", content=b"\xef\xbb\xbf" + b'{"trace_rate": "6"}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["trace_rate"] == "6", r.text


def test_opentelemetry_mode_is_refused_on_a_server_with_no_otlp_endpoint(http, stub):
    """Before: taken (200), and traced requests then made spans that went nowhere."""
    for route in ("/v2/trace/setting", "/v2/models/a/trace/setting"):
        error = refused(http.post(route, json={"trace_mode": "opentelemetry"}))
        assert "--otlp-traces-endpoint" in error
    with pytest.raises(grpc.RpcError) as info:
        grpc_settings(stub, "a", trace_mode=["opentelemetry"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert http.get("/v2/models/a/trace/setting").json() == RESET


def test_a_global_change_is_checked_for_the_models_that_inherit_it(http, tmp_path):
    """Before: a model with a file of its own inherited the global ``log_frequency`` (200),
    and its traces went to a ``.0`` file that is no trace array: every one dropped."""
    own = str(tmp_path / "m.json")
    r = http.post("/v2/models/a/trace/setting", json={"trace_file": own})
    assert r.status_code == 200, r.text
    (tmp_path / "m.json.0").write_text("not an array")
    error = refused(http.post("/v2/trace/setting", json={"log_frequency": "3"}))
    assert "model 'a' inherits this change" in error and "m.json.0" in error
    assert http.get("/v2/trace/setting").json() == RESET
    # a model that sets both keys itself inherits neither: the change is taken
    r = http.post("/v2/models/a/trace/setting", json={"log_frequency": "0"})
    assert r.status_code == 200, r.text
    r = http.post("/v2/trace/setting", json={"log_frequency": "3"})
    assert r.status_code == 200 and r.json()["log_frequency"] == "3", r.text
    assert http.get("/v2/models/a/trace/setting").json()["log_frequency"] == "0"


def test_clearing_log_frequency_while_setting_a_trace_file_is_taken(served, http, stub,
                                                                    tmp_path):
    """``{"trace_file": F, "log_frequency": null}`` was a 500 (and INTERNAL over gRPC)."""
    path = str(tmp_path / "t.json")
    for route in ("/v2/trace/setting", "/v2/models/a/trace/setting"):
        r = http.post(route, json={"trace_file": path, "log_frequency": None})
        assert r.status_code == 200, r.text
        assert (r.json()["trace_file"], r.json()["log_frequency"]) == (path, "0")
    doc = grpc_settings(stub, "a", trace_file=[path], log_frequency=[])
    assert (doc["trace_file"], doc["log_frequency"]) == ([path], ["0"])


def test_a_file_that_is_not_a_trace_array_is_refused_up_front(http, tmp_path):
    """It was taken (200) and every trace dropped later: the writer never writes over it."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    error = refused(http.post("/v2/trace/setting", json={"trace_file": str(notes)}))
    assert "JSON array" in error
    (tmp_path / "rotated.json.0").write_text("{}")
    error = refused(http.post("/v2/models/a/trace/setting",
                              json={"trace_file": str(tmp_path / "rotated.json"),
                                    "log_frequency": "5"}))
    assert "rotated.json.0" in error
    assert notes.read_text() == "my notes\n"
    assert http.get("/v2/models/a/trace/setting").json() == RESET
    # a trace array, or an empty file, is appended to
    (tmp_path / "old.json").write_text('[{"id": 1}]\n')
    (tmp_path / "empty.json").write_text("")
    for name in ("old.json", "empty.json"):
        r = http.post("/v2/trace/setting", json={"trace_file": str(tmp_path / name)})
        assert r.status_code == 200, r.text


def test_log_frequency_alone_checks_the_file_it_would_write(http, tmp_path):
    """``log_frequency`` N writes ``trace_file.0``: a name one character short of the
    longest was taken, then every trace dropped once N made it too long."""
    most = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = str(tmp_path / ("b" * (most - 1)))
    r = http.post("/v2/trace/setting", json={"trace_file": path})
    assert r.status_code == 200, r.text
    error = refused(http.post("/v2/trace/setting", json={"log_frequency": "10"}))
    assert "cannot write" in error and "long" in error
    assert http.get("/v2/trace/setting").json()["log_frequency"] == "0"


def test_unknown_model_names_are_quoted_short_over_http_and_grpc(http, stub):
    """A 10,000-character name was echoed whole: over gRPC its status did not fit the
    metadata limit, and the client got RESOURCE_EXHAUSTED instead of NOT_FOUND."""
    name = "x" * 10_000
    for r in (http.get(f"/v2/models/{name}/trace/setting"),
              http.post(f"/v2/models/{name}/trace/setting", json={"trace_rate": "5"}),
              http.get("/v2/trace/export", params={"model": name})):
        assert "unknown model" in refused(r, 404)
    for settings in ({}, {"trace_rate": ["5"]}):
        with pytest.raises(grpc.RpcError) as info:
            grpc_settings(stub, name, **settings)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()[:200]
        assert "unknown model" in info.value.details() and len(info.value.details()) < SHORT


def test_a_traced_generation_model_has_trace_settings_over_grpc_as_over_http(http, stub):
    """gRPC answered NOT_FOUND ("served over HTTP, not over gRPC") for the settings of a
    model the server traces, whose settings HTTP reads and changes."""
    doc = grpc_settings(stub, "decoder", trace_rate=["7"])
    assert doc["trace_rate"] == ["7"]
    assert http.get("/v2/models/decoder/trace/setting").json()["trace_rate"] == "7"
    assert grpc_settings(stub, "decoder")["trace_rate"] == ["7"]
    assert grpc_settings(stub)["trace_rate"] == ["1000"]  # the global ones are untouched


# -- traceparent ---------------------------------------------------------------------------------
def test_two_traceparents_or_one_with_stray_bytes_name_no_parent(served, http):
    """W3C Trace Context: two ``traceparent`` headers name no one parent, and a value with
    a byte outside the header's grammar (a NBSP, 0xa0) is malformed; the fast path joined
    the last of two, and the NBSP was stripped as white space. Each request is answered
    and traced as one without a parent (the settings trace every request)."""
    r = http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert r.status_code == 200, r.text
    good = f"00-{TRACE_ID}-{SPAN_ID}-01".encode()
    sent = [
        [(b"traceparent", good), (b"traceparent", f"00-{'1' * 32}-{SPAN_ID}-01".encode())],
        [(b"traceparent", good + b"\xa0")],
        [(b"traceparent", b"\xa0" + good)],
        [(b"traceparent", good)],  # the one that names a parent
    ]
    before = served.tracer.last_id
    for headers in sent:
        r = http.post("/v2/models/a/infer", json=BODY, headers=headers)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]
    rows = trace_rows_written(served.db, before, len(sent))
    assert [row.w3c_trace_id for row in rows] == [None, None, None, TRACE_ID]


# -- export --------------------------------------------------------------------------------------
@pytest.mark.parametrize("query, words", [
    # a parameter twice: the last one counted
    ("last=1&last=2", "more than once"),
    ("format=json&format=perfetto", "more than once"),
    # an end far out of range was told its window does not start before it ends, with a
    # 309-digit date
    ("end=1e308", "the year 2255"),
    ("end=-1e308", "before 1970"),
    # already refused well
    ("last=0", "a window of 0.001 to 600 seconds"),
    ("last=abc", "numbers of seconds"),
    ("end=", "numbers of seconds"),
    ("format=svg", "perfetto or json"),
    # were told in the command line's words: its options (an ISO date, now, -10s, a
    # start) are not this route's
    ("end=nan", "give finite numbers of seconds (end: epoch seconds"),
    ("last=nan", "give finite numbers of seconds"),
    ("last=inf", "give finite numbers of seconds"),
    ("end=now", "end: epoch seconds, e.g. 1767225600"),
    ("end=0", "give a later end or a smaller last"),
    # a window too short to have a start before its end at this end
    ("last=1e-7&end=1796583460", "a window of 0.001 to 600 seconds"),
])
def test_a_bad_export_query_gets_a_short_400(http, query, words):
    assert words in refused(http.get(f"/v2/trace/export?{query}"))


@pytest.mark.parametrize("headers, words", [
    ({"Origin": "https://evil.example"}, "other origins"),
    ({"Sec-Fetch-Site": "cross-site"}, "Sec-Fetch-Site: cross-site"),
    # DNS rebinding: a page whose name resolves to 127.0.0.1 read every recorded request
    ({"Host": "attacker.example:8000", "Origin": "http://attacker.example:8000"},
     "loopback address in Host"),
])
def test_an_export_is_refused_to_other_sites_and_rebound_names(http, headers, words):
    assert words in refused(http.get("/v2/trace/export?last=5&format=json", headers=headers),
                            403)


def test_an_export_that_cannot_make_its_folder_fails_alone(http, monkeypatch, tmp_path):
    """A temporary folder that cannot be had was a 500 and left the export marked as
    running: every later export was refused with 429 for good."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    assert "no room" in refused(http.get("/v2/trace/export?last=5"), 503)
    monkeypatch.undo()
    r = http.get("/v2/trace/export?last=5&format=json")
    assert r.status_code == 200, r.text
    assert r.json()["otherData"]["source"] == "BatchScope"


def test_two_traceparents_name_no_parent_on_the_starlette_routes(served, http):
    """As on the fast path: a request the Starlette routes answer (here OpenAI-style, to
    the generation model) with two ``traceparent`` headers follows neither (it took the
    first of two). (gRPC hands a server only the last of a repeated metadata key.)"""
    r = http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert r.status_code == 200, r.text
    good = f"00-{TRACE_ID}-{SPAN_ID}-01".encode()
    two = [(b"traceparent", good), (b"traceparent", f"00-{'1' * 32}-{SPAN_ID}-01".encode())]
    prompt = {"model": "decoder", "prompt": "hi", "max_tokens": 2}
    before = served.tracer.last_id
    for headers in (two, [(b"traceparent", good)]):
        r = http.post("/v1/completions", json=prompt, headers=headers)
        assert r.status_code == 200, r.text
    rows = trace_rows_written(served.db, before, 2)
    assert [row.w3c_trace_id for row in rows] == [None, TRACE_ID]


def test_a_failed_export_is_told_by_its_cause_and_its_detail_stays_on_the_machine():
    """The server answers for its ``batchscope trace`` child by the child's exit status,
    and passes the child's line (file paths, the database's host) to local clients only."""
    from batchscope.trace.exits import EXIT_NO_ROOM, EXIT_TOO_MANY_ROWS
    from runtime.api.errors import InsufficientStorage, RequestTooLarge, ServerBusy
    from runtime.server.trace_api import export_failed

    too_many = ("batchscope trace: the window holds 250,000 batches and requests, more than "
                "200,000 can be read at once; pick a window of at most 1,200 s (or one "
                "model or instance); or raise --max-rows (the rows are read into memory)\n")
    for local in (True, False):
        error = export_failed(EXIT_TOO_MANY_ROWS, too_many, local)
        assert isinstance(error, RequestTooLarge)
        # the route's own words: it takes last= and model=, and no instance or --max-rows
        assert "ask for last=1200 or less, or for one model (model=NAME)" in str(error)
        assert "--max-rows" not in str(error) and "instance" not in str(error)
    full = "batchscope trace: cannot write /tmp/batchscope-export-x/trace.json: No space left"
    here, there = export_failed(EXIT_NO_ROOM, full, True), export_failed(EXIT_NO_ROOM, full, False)
    assert isinstance(here, InsufficientStorage) and isinstance(there, InsufficientStorage)
    assert "/tmp/" in str(here) and "/tmp/" not in str(there) and "room" in str(there)
    locked = "batchscope trace: cannot connect to the database at postgresql://db.internal:5432"
    here, there = export_failed(2, locked, True), export_failed(2, locked, False)
    assert isinstance(here, ServerBusy) and "db.internal" in str(here)
    assert isinstance(there, ServerBusy) and "db.internal" not in str(there)
    assert "log" in str(there)
