"""Hostile and malformed requests against a real ``batchscope serve``, on every route.

    python -m benchmarks.reliability.hostile --minutes 10

Starts ``batchscope serve`` (models mlp, encoder and decoder; HTTP and gRPC; the
defaults otherwise) in a child process and sends it requests drawn from the
``hypothesis`` strategies below: KServe v2 JSON and binary bodies (shapes that declare
huge or empty batches, dimensions past any bound, wrong sizes, gzip bombs), gRPC
``ModelInferRequest``s, OpenAI completions, chat and embeddings (``n``, ``max_tokens``,
prompt and input lists, long texts), control API changes that must be refused, floods
of headers, and the trace surfaces: W3C ``traceparent`` headers on inference requests
(well formed, sampled or not, malformed, repeated), Triton's trace settings over HTTP
and gRPC (valid changes too, so that tracing at every request meets the other families'
requests) and the trace export's parameters. The server records to a throw-away SQLite
file, as ``batchscope serve`` does by default, so the export reads a real database, and
runs in that file's folder, so that no file it writes lands in this checkout. While they
run, a prober asks ``GET /v2/health/live`` every 20 ms on its own connection: its slowest
answer bounds how long the event loop stalled.

Every request must be answered within a second with a status under 500 (a 503 saying
the request's own, too short, timeout passed in the queue is that request's one proper
answer and counts apart); the server's
resident memory (with its child processes) must stay within 100 MiB of what it held
after warm-up; it must still serve a good request at the end and stop on SIGTERM.
The report prints counts by status, the slowest answer, the prober's worst gap and
the memory. The test suite runs a short version of the same (``tests/test_hostile_requests.py``).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import http.client
import json
import os
import re
import signal
import string
import struct
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from benchmarks.reliability.server import ROOT, Server

#: what the generated requests name: the served models and their inputs
MODELS = {"mlp": ("INPUT0", "FP32", [256]), "encoder": ("INPUT_IDS", "INT64", [-1])}
GENERATION = "decoder"
DATATYPES = ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "NOPE"]
#: an answer slower than this, a status of 500 or more, or a dropped connection fails
ANSWER_LIMIT_S = 1.0
MEMORY_LIMIT_MB = 100.0


@dataclass(frozen=True)
class HttpAttack:
    what: str
    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    #: a good request: answered 200 whatever else it carries (see ``Outcome.failed``)
    good: bool = False


@dataclass(frozen=True)
class GrpcAttack:
    what: str
    #: a serialized request message of ``method`` (``ModelInferRequest`` by default)
    message: bytes
    method: str = "ModelInfer"


# -- strategies ---------------------------------------------------------------------------
_huge = st.sampled_from([2**31, 2**32, 2**40, 2**62, 2**63 - 1, 10**18, 2**64])
_dim = st.one_of(st.integers(0, 8), st.integers(0, 70_000), _huge, st.integers(-5, -1),
                 st.sampled_from([1.5, "3", None, True, [2]]))
_shape = st.one_of(st.lists(_dim, min_size=0, max_size=4),
                   st.lists(st.integers(0, 2), min_size=60, max_size=70),
                   st.sampled_from([[2**32, 0], [0, 2**32], [65536, 0], [1025, 0], [1, 0, 10**9],
                                    "x", None, {}, [[1]]]))
_scalar = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.text(max_size=8),
                    st.booleans(), st.none())
_json = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                      st.dictionaries(st.text(max_size=6), inner,
                                                                      max_size=4)),
                     max_leaves=20)
_data = st.one_of(st.lists(st.floats(allow_nan=False, width=32), max_size=300),
                  st.lists(st.integers(-2**40, 2**40), max_size=300),
                  st.lists(st.lists(st.integers(0, 300), max_size=8), max_size=8),
                  st.lists(st.text(max_size=10), max_size=20), _json)
_params = st.one_of(st.none(), st.dictionaries(
    st.sampled_from(["priority", "timeout", "realtime", "bypass", "binary_data_output",
                     "binary_data_size", "x"]), _scalar, max_size=4), _json)


_HEX = "0123456789abcdef"
#: a W3C ``traceparent``: well formed (sampled or not), or malformed in each way the
#: standard names (all-zero ids, version ff, upper case, more after a version 00 header),
#: or any header text (printable ASCII: what an HTTP client can send)
_traceparent = st.one_of(
    st.builds(lambda t, p, f: f"00-{t}-{p}-{f}", st.text(_HEX, min_size=32, max_size=32),
              st.text(_HEX, min_size=16, max_size=16), st.sampled_from(["01", "00", "ff", "03"])),
    st.sampled_from(["00-" + "0" * 32 + "-" + "1" * 16 + "-01",
                     "00-" + "1" * 32 + "-" + "0" * 16 + "-01",
                     "ff-" + "1" * 32 + "-" + "1" * 16 + "-01",
                     "00-" + "A" * 32 + "-" + "B" * 16 + "-01",
                     "00-" + "1" * 32 + "-" + "1" * 16 + "-01-extra",
                     "01-" + "1" * 32 + "-" + "1" * 16 + "-01-more", "", " ", "-" * 55]),
    st.text(string.printable.strip("\r\n\x0b\x0c"), max_size=80),
    st.integers(0, 9000).map(lambda n: "00-" + "1" * n))


def _traceparents(draw) -> list[tuple[str, str]]:
    """None, one or several ``traceparent`` headers (several name no one parent)."""
    return [("traceparent", draw(_traceparent)) for _ in range(draw(st.sampled_from([0, 0, 1,
                                                                                     1, 2, 3])))]


@st.composite
def kserve_json(draw) -> HttpAttack:
    model = draw(st.sampled_from([*MODELS, "nope"]))
    name, datatype, shape = MODELS.get(model, ("X", "FP32", [4]))
    tensor: dict[str, Any] = {
        "name": draw(st.one_of(st.just(name), st.text(max_size=6), _scalar)),
        "shape": draw(st.one_of(_shape, st.just(shape if shape != [-1] else [4]))),
        "datatype": draw(st.one_of(st.just(datatype), st.sampled_from(DATATYPES), _scalar)),
    }
    if draw(st.booleans()):
        tensor["data"] = draw(_data)
    if draw(st.booleans()):
        tensor["parameters"] = draw(_params)
    inputs = draw(st.one_of(st.lists(st.just(tensor), min_size=1, max_size=3),
                            st.lists(_json, max_size=3), _json))
    doc: dict[str, Any] = {"inputs": inputs}
    for key in ("parameters", "outputs", "id"):
        if draw(st.booleans()):
            doc[key] = draw(_params if key == "parameters" else _json)
    body = json.dumps(doc).encode()
    headers: list[tuple[str, str]] = [("content-type", "application/json"),
                                      *_traceparents(draw)]
    if draw(st.integers(0, 5)) == 0:
        headers.append(("content-encoding", "gzip"))
        body = gzip.compress(body)
    return HttpAttack("kserve json", "POST", f"/v2/models/{model}/infer", body, tuple(headers))


@st.composite
def kserve_binary(draw) -> HttpAttack:
    model = draw(st.sampled_from(list(MODELS)))
    name, datatype, _ = MODELS[model]
    shape = draw(_shape)
    size = draw(st.one_of(st.integers(0, 4096), _huge, st.integers(-3, -1), _scalar))
    head = json.dumps({"inputs": [{"name": name, "datatype": draw(st.sampled_from(DATATYPES)),
                                   "shape": shape,
                                   "parameters": {"binary_data_size": size}}]}).encode()
    blob = draw(st.binary(max_size=4096))
    if draw(st.booleans()):  # BYTES elements whose lengths say more than there is
        blob = struct.pack("<I", draw(st.integers(0, 2**32 - 1))) + blob
    header_length = draw(st.one_of(st.just(str(len(head))), st.integers(-5, 10**12).map(str),
                                   st.text(string.ascii_letters + "-+ ", max_size=5)))
    return HttpAttack("kserve binary", "POST", f"/v2/models/{model}/infer", head + blob,
                      (("content-type", "application/octet-stream"),
                       ("inference-header-content-length", header_length)))


@functools.lru_cache(maxsize=None)
def _bomb(size: int, json_doc: bool) -> bytes:
    """Made once: compressing 70 MB takes the client's CPU away from the server."""
    raw = (b'{"inputs":[{"name":"INPUT_IDS","shape":[1],"datatype":"INT64","data":['
           + b"0," * (size // 2) + b"0]}]}") if json_doc else b"0" * size
    return gzip.compress(raw, 1)


@st.composite
def compressed_bomb(draw) -> HttpAttack:
    """A small gzip body that inflates far past any limit, or to a huge JSON document."""
    body = _bomb(draw(st.sampled_from([8 << 20, 70 << 20])), draw(st.booleans()))
    model = draw(st.sampled_from(list(MODELS)))
    return HttpAttack("gzip bomb", "POST", f"/v2/models/{model}/infer", body,
                      (("content-encoding", "gzip"), ("content-type", "application/json")))


_prompt = st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 2**40), max_size=40),
                    st.lists(st.text(max_size=5), max_size=400),
                    st.lists(st.lists(st.integers(0, 300), max_size=5), max_size=50),
                    st.integers(0, 10**6).map(lambda n: "x" * n), _json)


@st.composite
def openai(draw) -> HttpAttack:
    route = draw(st.sampled_from(["completions", "chat/completions", "embeddings"]))
    body: dict[str, Any] = {"model": draw(st.one_of(
        st.just("encoder" if route == "embeddings" else GENERATION), st.text(max_size=5), _scalar))}
    if route == "embeddings":
        body["input"] = draw(st.one_of(_prompt, st.lists(st.just("ab"), min_size=1000,
                                                           max_size=3000)))
    elif route == "completions":
        body["prompt"] = draw(_prompt)
    else:
        body["messages"] = draw(st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                            "content": st.one_of(st.text(max_size=20), _json)}),
                     max_size=300), _json))
    for key, values in (("n", st.one_of(st.integers(-2, 300), _huge, _scalar)),
                        ("max_tokens", st.one_of(st.integers(-2, 48), _huge, _scalar)),
                        ("temperature", _scalar), ("stop", st.one_of(_json, st.lists(
                            st.text(max_size=300), max_size=6))),
                        ("stream", _scalar), ("seed", st.one_of(_huge, _scalar)),
                        ("priority", _scalar), ("timeout_ms", _scalar),
                        ("encoding_format", st.sampled_from(["float", "base64", "x"]))):
        if draw(st.integers(0, 2)) == 0:
            body[key] = draw(values)
    return HttpAttack(f"openai {route}", "POST", f"/v1/{route}", json.dumps(body).encode(),
                      (("content-type", "application/json"), *_traceparents(draw)))


@st.composite
def control(draw) -> HttpAttack:
    """A settings change that must be refused: every change holds one invalid field."""
    model = draw(st.sampled_from([*MODELS, GENERATION, "nope"]))
    bad = draw(st.sampled_from([("max_batch_size", -1), ("max_batch_size", 2**70),
                                ("max_queue_size", "lots"), ("max_queue_delay_ms", -5),
                                ("bucket_edges", list(range(100_000))), ("nope", 1),
                                ("preferred_batch_sizes", [[1]])]))
    changes = draw(st.dictionaries(st.text(max_size=8), _json, max_size=3))
    changes[bad[0]] = bad[1]
    body = draw(st.one_of(st.just(json.dumps(changes).encode()), st.binary(max_size=50)))
    return HttpAttack("control", draw(st.sampled_from(["POST", "PATCH"])),
                      f"/v2/models/{model}/batching", body, (("content-type", "application/json"),))


@st.composite
def traced_requests(draw) -> HttpAttack:
    """Good requests (KServe, OpenAI completion and embeddings) with any ``traceparent``
    headers: each is answered, traced where a well-formed sampled header asks for it or
    the trace settings sample it, its spans joining the caller's trace."""
    route = draw(st.sampled_from(["kserve", "kserve", "completions", "embeddings"]))
    if route == "kserve":
        path, doc = "/v2/models/mlp/infer", {"inputs": [{
            "name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": [0.25] * 256}]}
        if draw(st.booleans()):
            doc["id"] = draw(st.text(string.ascii_letters, max_size=300))
    elif route == "completions":
        path, doc = "/v1/completions", {"model": GENERATION, "prompt": "ab", "max_tokens": 2,
                                        "stream": draw(st.booleans())}
    else:
        path, doc = "/v1/embeddings", {"model": "encoder", "input": ["ab", "cd"]}
    return HttpAttack("traced requests", "POST", path, json.dumps(doc).encode(),
                      (("content-type", "application/json"), *_traceparents(draw)), good=True)


#: Triton's trace settings (``runtime.core.tracing.KEYS``), and misspelt or unknown ones
_TRACE_KEYS = ["trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode",
               "trace_file"]
_BAD_TRACE_KEYS = ["TRACE_LEVEL", "trace-rate", "nope", ""]


def _trace_keys(draw) -> list[str]:
    """Some of Triton's trace settings, now and then with an unknown one among them."""
    keys = draw(st.lists(st.sampled_from(_TRACE_KEYS), max_size=3, unique=True))
    if draw(st.integers(0, 3)) == 0:
        keys.append(draw(st.sampled_from(_BAD_TRACE_KEYS)))
    return keys


_count_text = st.one_of(st.integers(-3, 2000).map(str), _huge.map(str),
                        st.sampled_from(["1.5", "1e3", " 10", "0x10", "", "-0", "+5", "１０",
                                         "NaN", "inf"]))
_TRACE_VALUES = {
    "trace_level": st.one_of(st.lists(st.sampled_from(["OFF", "TIMESTAMPS", "TENSORS", "off",
                                                       "x", ""]), max_size=3),
                             st.sampled_from(["TIMESTAMPS", "OFF"])),
    "trace_rate": _count_text, "trace_count": _count_text, "log_frequency": _count_text,
    "trace_mode": st.sampled_from(["triton", "triton", "opentelemetry", "TRITON", "x", ""]),
    # never a file the server could write: a directory, a missing one, nothing
    "trace_file": st.sampled_from(["", "/", "/proc", "/nonexistent-batchscope-dir/t.json",
                                   "/dev/null/t.json", "\x00"]),
}


def _trace_value(draw, key: str) -> Any:
    """A value for trace setting ``key``: mostly of its own kind, now and then of a wrong
    type. A ``trace_file`` is never any other text (a relative path or one under ``/``
    would be a file the server may write)."""
    values = _TRACE_VALUES.get(key, _json)
    if draw(st.integers(0, 3)):
        return draw(values)
    wrong = st.one_of(st.lists(values, max_size=2), st.none(), st.integers(), st.booleans(),
                      st.floats(allow_nan=False))
    return draw(wrong if key == "trace_file" else st.one_of(wrong, _scalar))


@st.composite
def trace_settings(draw) -> HttpAttack:
    """Triton's trace settings read or changed, globally or for a model: valid changes
    (tracing every request, a count, OFF again) among bad keys, values, types and bodies."""
    model = draw(st.sampled_from([None, None, None, *MODELS, GENERATION, "nope", "%2e%2e",
                                  "a" * 300]))
    path = "/v2/trace/setting" if model is None else f"/v2/models/{model}/trace/setting"
    if draw(st.integers(0, 4)) == 0:
        return HttpAttack("trace settings", draw(st.sampled_from(["GET", "PUT", "DELETE"])),
                          path)
    doc = {key: _trace_value(draw, key) for key in _trace_keys(draw)}
    body = json.dumps(doc).encode()
    body = draw(st.sampled_from([body, body, b"\xef\xbb\xbf" + body,  # a UTF-8 BOM
                                 body[:-1] + b',"trace_rate":"1","trace_rate":"2"}'
                                 if len(body) > 2 else body,  # a key twice
                                 b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe{}",
                                 json.dumps([doc]).encode()]))
    content_type = draw(st.sampled_from(["application/json", "application/json",
                                         "application/json", "text/plain", None]))
    headers = (("content-type", content_type),) if content_type else ()
    return HttpAttack("trace settings", "POST", path, body, headers)


_export_value = st.one_of(st.sampled_from(["1", "0.5", "10", "0", "-1", "601", "1e309", "nan",
                                           "inf", "perfetto", "json", "chrome", "mlp", "nope",
                                           "1767225600", "-62135596800", "99999999999", ""]),
                          st.text(string.ascii_letters + string.digits + ".-+:%", max_size=20))


@st.composite
def trace_export(draw) -> HttpAttack:
    """``GET /v2/trace/export`` with any parameters: windows too long, too short, not
    numbers, before 1970 or far ahead, unknown formats and keys, a key twice."""
    from urllib.parse import quote

    keys = draw(st.lists(st.sampled_from(["last", "format", "model", "end"]), max_size=4))
    if draw(st.integers(0, 3)) == 0:  # the CLI's flags, and none at all
        keys.append(draw(st.sampled_from(["start", "max_rows", "x", ""])))
    if draw(st.integers(0, 3)) == 0:  # a small window that exists: a real export
        keys = ["last", "format"]
        pairs = [("last", "1"), ("format", draw(st.sampled_from(["json", "perfetto"])))]
    else:
        pairs = [(k, draw(_export_value)) for k in keys]
    query = "&".join(f"{k}={quote(v)}" for k, v in pairs)
    return HttpAttack("trace export", "GET", "/v2/trace/export" + ("?" + query if query else ""))


@st.composite
def header_flood(draw) -> HttpAttack:
    count = draw(st.sampled_from([50, 101, 500, 3000]))
    size = draw(st.sampled_from([10, 1000, 70_000]))
    headers = tuple((f"x-h{i}", "v" * size) for i in range(count if size < 1000 else 3))
    return HttpAttack("headers", "GET", "/v2/health/live", b"", headers)


@st.composite
def grpc_infer(draw) -> GrpcAttack:
    from runtime.server.grpc.protocol import message

    request = message("ModelInferRequest")(model_name=draw(st.sampled_from([*MODELS, "nope"])),
                                           id=draw(st.text(max_size=5)))
    name, datatype, _ = MODELS.get(request.model_name, ("X", "FP32", [4]))
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(name=draw(st.sampled_from([name, "X", ""])),
                                    datatype=draw(st.sampled_from(DATATYPES)))
        tensor.shape.extend(draw(st.lists(st.one_of(st.integers(-3, 70_000), _huge.filter(
            lambda v: v < 2**63)), max_size=4)))
        kind = draw(st.integers(0, 3))
        if kind == 0:
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32,
                                                                         allow_nan=False),
                                                               max_size=300)))
        elif kind == 1:
            tensor.contents.int64_contents.extend(draw(st.lists(st.integers(-2**63, 2**63 - 1),
                                                                max_size=300)))
        elif kind == 2:
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=4),
                                                                max_size=100)))
        else:
            request.raw_input_contents.append(draw(st.binary(max_size=2048)))
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "shared_memory_region"]),
                             max_size=2)):
        param = request.parameters[key]
        value = draw(st.one_of(st.integers(-2**62, 2**62), st.text(max_size=4), st.booleans()))
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        else:
            param.string_param = value
    return GrpcAttack("grpc infer", request.SerializeToString())


@st.composite
def grpc_trace_setting(draw) -> GrpcAttack:
    """The gRPC ``TraceSetting`` call, with the HTTP family's keys and values."""
    from runtime.server.grpc.protocol import message

    request = message("TraceSettingRequest")(model_name=draw(st.sampled_from(
        ["", *MODELS, GENERATION, "nope", "a" * 300])))
    for key in _trace_keys(draw):
        value = draw(_TRACE_VALUES.get(key, st.text(max_size=8)))
        values = value if isinstance(value, list) else [value]
        request.settings[key].value.extend(draw(st.sampled_from([values, [], values * 2])))
    return GrpcAttack("grpc trace setting", request.SerializeToString(), "TraceSetting")


@st.composite
def other_routes(draw) -> HttpAttack:
    """Any route with any method and body: metadata, readiness, statistics, the
    repository index, metrics, unknown paths."""
    model = draw(st.sampled_from([*MODELS, GENERATION, "nope", "../x", ""]))
    path = draw(st.sampled_from([
        "/v2", "/v2/health/live", "/v2/health/ready", f"/v2/models/{model}",
        f"/v2/models/{model}/ready", f"/v2/models/{model}/config", f"/v2/models/{model}/stats",
        "/v2/models/stats", "/v2/repository/index", f"/v2/models/{model}/batching/stats",
        f"/v2/models/{model}/versions/7/infer", "/v1/models", f"/v1/models/{model}",
        "/metrics", "/nope", "/v2/models//infer", "/%ff%fe"]))
    body = draw(st.one_of(st.just(b""), st.binary(max_size=200),
                          _json.map(lambda v: json.dumps(v).encode())))
    return HttpAttack("other routes", draw(st.sampled_from(["GET", "POST", "PUT", "DELETE",
                                                            "PATCH", "HEAD", "OPTIONS"])),
                      path, body, (("content-type", "application/json"),))


HTTP_STRATEGIES = {"kserve json": kserve_json(), "kserve binary": kserve_binary(),
                   "openai": openai(), "control": control(), "headers": header_flood(),
                   "gzip bomb": compressed_bomb(), "other routes": other_routes(),
                   "trace settings": trace_settings(), "trace export": trace_export(),
                   "traced requests": traced_requests()}
GRPC_STRATEGIES = {"grpc infer": grpc_infer(), "grpc trace setting": grpc_trace_setting()}
#: every family but the export's, drawn alike; a trace export (a process of its own,
#: about a second) is drawn once every ``EXPORT_EVERY_S`` instead
ANY_ATTACK = st.one_of(*(s for k, s in HTTP_STRATEGIES.items() if k != "trace export"),
                       *GRPC_STRATEGIES.values())
EXPORT_EVERY_S = 5.0


# -- sending and checking -----------------------------------------------------------------
@dataclass
class Outcome:
    what: str
    status: int | str
    seconds: float
    detail: str = ""
    #: the request was a good one (``HttpAttack.good``): anything but 200 fails
    good: bool = False

    def failed(self, limit_s: float = ANSWER_LIMIT_S) -> bool:
        """A 5xx, a dropped connection, an error without a JSON ``error``, a refusal
        slower than ``limit_s`` (work that was accepted may take its time), or a good
        request not answered 200."""
        if self.good and self.status != 200:
            return True
        if self.status == 503 and "past its timeout" in self.detail:
            return False  # it asked for a deadline it could not meet, and was told at it
        if not isinstance(self.status, int) or self.status >= 500:
            return True
        return self.status != 200 and self.seconds > limit_s


class Target:
    """One running server: HTTP connections and a gRPC channel to it."""

    def __init__(self, url: str, grpc_address: str | None) -> None:
        match = re.match(r"http://([^:/]+):(\d+)", url)
        assert match, url
        self.host, self.port = match.group(1), int(match.group(2))
        self.grpc_address = grpc_address
        self._conn: http.client.HTTPConnection | None = None
        self._calls: dict[str, Any] = {}
        if grpc_address is not None:
            import grpc

            self._channel = grpc.insecure_channel(grpc_address)
            self._calls = {method: self._channel.unary_unary(
                f"/inference.GRPCInferenceService/{method}",
                request_serializer=lambda b: b, response_deserializer=lambda b: b)
                for method in ("ModelInfer", "TraceSetting")}

    def send(self, attack: HttpAttack | GrpcAttack) -> Outcome:
        start = time.perf_counter()
        if isinstance(attack, GrpcAttack):
            return self._send_grpc(attack, start)
        outcome = self._send_http(attack, start)
        outcome.good = attack.good
        return outcome

    def _send_http(self, attack: HttpAttack, start: float) -> Outcome:
        conn = self._conn or http.client.HTTPConnection(self.host, self.port, timeout=10)
        self._conn = None
        try:
            conn.putrequest(attack.method, attack.path, skip_accept_encoding=True)
            for key, value in attack.headers:
                conn.putheader(key, value)
            conn.putheader("content-length", str(len(attack.body)))
            conn.endheaders(attack.body)
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            return Outcome(attack.what, type(exc).__name__, time.perf_counter() - start,
                           str(exc)[:200])
        seconds = time.perf_counter() - start
        if not response.will_close:
            self._conn = conn
        else:
            conn.close()
        detail = ""
        if response.status >= 400 and attack.method != "HEAD":  # HEAD: the head alone
            try:
                doc = json.loads(body)
                detail = str(doc.get("error") or doc)[:200]
            except (ValueError, AttributeError):
                return Outcome(attack.what, f"{response.status} without a JSON error", seconds,
                               body[:200].decode("latin-1"))
            if not detail:
                return Outcome(attack.what, f"{response.status} with an empty error", seconds)
        return Outcome(attack.what, response.status, seconds, detail)

    def _send_grpc(self, attack: GrpcAttack, start: float) -> Outcome:
        import grpc

        try:
            self._calls[attack.method](attack.message, timeout=10)
            return Outcome(attack.what, 200, time.perf_counter() - start)  # gRPC's OK
        except grpc.RpcError as exc:
            code = exc.code()
            seconds = time.perf_counter() - start
            ok = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
                          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)
            # a 4xx-like refusal counts as 400, anything else (INTERNAL, UNKNOWN, ...) fails
            return Outcome(attack.what, 400 if ok else str(code), seconds,
                           (exc.details() or "")[:200])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self.grpc_address is not None:
            self._channel.close()


def _probe(conn: Any, host: str, port: int, interval_s: float) -> None:
    """The prober's own process (so that generating requests cannot delay it): probes
    until told to stop, then sends back (spans, failures)."""
    spans: list[tuple[float, float]] = []
    failures = 0
    client = http.client.HTTPConnection(host, port, timeout=10)
    while not conn.poll(interval_s):
        start = time.perf_counter()
        try:
            client.request("GET", "/v2/health/live")
            client.getresponse().read()
        except (OSError, http.client.HTTPException):
            failures += 1
            client.close()
            client = http.client.HTTPConnection(host, port, timeout=10)
            continue
        spans.append((start, time.perf_counter() - start))
    client.close()
    conn.send((spans, failures))


class Prober:
    """Asks ``GET /v2/health/live`` every ``interval_s`` on its own connection, from a
    process of its own (``batchscope.spawn``); the slowest answer bounds how long the
    server's event loop stalled."""

    def __init__(self, target: Target, interval_s: float = 0.02) -> None:
        from batchscope.spawn import spawn_child
        # by its module's name: run as ``python -m``, this file is ``__main__``
        from benchmarks.reliability.hostile import _probe as probe

        self._child = spawn_child(probe, (target.host, target.port, interval_s),
                                  name="batchscope-hostile-prober")
        #: (start, seconds) of every probe, once stopped
        self.spans: list[tuple[float, float]] = []
        self.failures = 0

    def slowest(self, sent: list[tuple[float, float, str]], n: int = 5) -> list[str]:
        """The ``n`` slowest probes and the requests in flight during each (``sent``:
        (start, end, what) of every request)."""
        out = []
        for start, seconds in sorted(self.spans, key=lambda s: -s[1])[:n]:
            during = Counter(what for a, b, what in sent if a < start + seconds and b > start)
            out.append(f"{seconds * 1e3:.0f} ms during {dict(during)}")
        return out

    def stop(self) -> dict[str, float]:
        conn = self._child.conn
        conn.send("stop")
        if not conn.poll(60):
            raise RuntimeError("the prober did not answer")
        self.spans, self.failures = conn.recv()
        self._child.process.join(15)
        times = sorted(t for _, t in self.spans) or [float("nan")]
        return {"probes": len(self.spans), "failures": self.failures,
                "p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3, "max_ms": times[-1] * 1e3}


def good_request(target: Target) -> Outcome:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [256], "datatype": "FP32",
                                   "data": [0.5] * 256}]}).encode()
    return target.send(HttpAttack("good", "POST", "/v2/models/mlp/infer", body,
                                  (("content-type", "application/json"),)))


def start_server(db_path: str | None = None,
                 extra: tuple[str, ...] = ()) -> tuple[Server, Target]:
    """The server, recording to SQLite file ``db_path`` and running in its folder (a file
    a relative path names lands there; None: recording nothing, running in this
    checkout)."""
    record = ["--no-record"] if db_path is None else ["--db", f"sqlite:///{db_path}"]
    where = {} if db_path is None else {"cwd": os.path.dirname(os.path.abspath(db_path)),
                                        "code": ROOT}
    server = Server([sys.executable, "-m", "runtime", "serve", "--port", "0", "--grpc-port", "0",
                     *record, "--model", "mlp", "--model", "encoder", "--model", "decoder",
                     *extra], **where)
    match = None
    for line in server.tail:
        match = re.search(r"grpc: (\S+:\d+)", line) or match
    assert server.url is not None
    return server, Target(server.url, match.group(1) if match else None)


def stop_server(server: Server, timeout_s: float = 30.0) -> float:
    """SIGTERM the server; the seconds it took to exit (inf when it did not)."""
    start = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=timeout_s)
    except Exception:
        server.proc.kill()
        return float("inf")
    return time.perf_counter() - start


@dataclass
class Report:
    statuses: Counter = field(default_factory=Counter)
    failures: list[Outcome] = field(default_factory=list)
    slowest_s: float = 0.0
    sent: int = 0
    failed: int = 0

    def add(self, outcome: Outcome) -> None:
        self.sent += 1
        self.statuses[f"{outcome.what}: {outcome.status}"] += 1
        self.slowest_s = max(self.slowest_s, outcome.seconds)
        if outcome.failed():
            self.failed += 1
            if len(self.failures) < 50:
                self.failures.append(outcome)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")  # .example() outside a test says it is for exploration
    folder = tempfile.TemporaryDirectory(prefix="batchscope-hostile-")
    server, target = start_server(os.path.join(folder.name, "hostile.db"))
    try:
        for _ in range(20):  # warm-up: the first answers of each model allocate
            good_request(target)
        time.sleep(1.0)
        rss_start = server.rss_mb()
        rss_peak = rss_start
        prober = Prober(target)
        report = Report()
        end = time.monotonic() + args.minutes * 60
        sent: list[tuple[float, float, str]] = []
        next_export = time.monotonic()
        while time.monotonic() < end:
            if time.monotonic() >= next_export:
                attack = HTTP_STRATEGIES["trace export"].example()
                next_export = time.monotonic() + EXPORT_EVERY_S
            else:
                attack = ANY_ATTACK.example()
            start = time.perf_counter()
            report.add(target.send(attack))
            sent.append((start, time.perf_counter(), attack.what))
            if report.sent % 50 == 0:
                rss_peak = max(rss_peak, server.rss_mb())
        probes = prober.stop()
        rss_end = server.rss_mb()
        final = good_request(target)
    finally:
        target.close()
        exit_s = stop_server(server)
        folder.cleanup()
    result = {
        "minutes": args.minutes, "requests": report.sent,
        "failed": report.failed, "slowest_answer_ms": round(report.slowest_s * 1e3, 1),
        "loop_probe": {k: round(v, 1) for k, v in probes.items()},
        "rss_mb": {"start": round(rss_start, 1), "peak": round(rss_peak, 1),
                   "end": round(rss_end, 1)},
        "good_request_after": final.status, "exit_after_sigterm_s": round(exit_s, 2),
        "slowest_probes": prober.slowest(sent),
        "statuses": dict(sorted(report.statuses.items())),
        "failures": [vars(f) for f in report.failures[:10]],
    }
    ok = (not report.failures and final.status == 200 and exit_s < 30
          and rss_peak - rss_start <= MEMORY_LIMIT_MB)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if key == "statuses":
                print("statuses:")
                for k, v in value.items():
                    print(f"  {v:7d}  {k}")
            else:
                print(f"{key}: {value}")
        print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
