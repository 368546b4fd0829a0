"""Hostile and malformed ``/infer`` bodies: every one is a clear 400, never a numpy error.

A table over shapes (too many dimensions, element counts past any limit, negative,
non-integer dimensions), datatypes and data (non-lists, BYTES that are not strings,
BOOL that is not true/false) and the binary tensor extension (sizes that are not
integers, do not match shape x datatype, miss bytes or leave bytes over, BYTES
elements that overrun), in JSON and binary form; then the same through the real
server, which must answer each with a 400 ``{"error": ...}``.
"""

from __future__ import annotations

import orjson
import pytest

from runtime.api.errors import BatchScopeError, ClientError
from runtime.api.model import TensorSpec
from runtime.server.kserve import MAX_DIMS, MAX_ELEMENTS, parse_infer

ANY = (TensorSpec("X", "FP32", (-1,)),)
TEXT = (TensorSpec("T", "BYTES", (-1,)),)
FLAGS = (TensorSpec("B", "BOOL", (-1,)),)
OUTPUTS = (TensorSpec("O", "FP32", (-1,)),)


def tensor(shape, datatype="FP32", data=None, name="X", **fields):
    t = {"name": name, "shape": shape, "datatype": datatype}
    if data is not None:
        t["data"] = data
    t.update(fields)
    return t


def json_body(*inputs, **extra) -> tuple[bytes, None]:
    return orjson.dumps({"inputs": list(inputs), **extra}), None


def binary_body(inputs, blob: bytes) -> tuple[bytes, str]:
    head = orjson.dumps({"inputs": inputs})
    return head + blob, str(len(head))


def sized(shape, size, datatype="FP32", name="X"):
    return tensor(shape, datatype, name=name, parameters={"binary_data_size": size})


def strings(*items: bytes) -> bytes:
    return b"".join(len(s).to_bytes(4, "little") + s for s in items)


CASES = {
    # shapes, in JSON
    "too many dimensions": (json_body(tensor([1] * (MAX_DIMS + 1), data=[1.0])), ANY,
                            f"{MAX_DIMS + 1} dimensions, more than the {MAX_DIMS}"),
    "too many zero dimensions": (json_body(tensor([0] * (MAX_DIMS + 1), data=[])), ANY,
                                 "dimensions, more than"),
    "element count overflows": (json_body(tensor([0, 2**62, 2**62], data=[])), ANY,
                                "describes more elements than a tensor may have"),
    "huge dimension beside a zero": (json_body(tensor([0, 10**18], data=[])), ANY,
                                     "describes more elements"),
    "huge product": (json_body(tensor([2**32, 2**32], data=[1.0])), ANY,
                     f"({MAX_ELEMENTS})"),
    "negative dimension": (json_body(tensor([-1], data=[1.0])), ANY, "non-negative integers"),
    "dimension as a float": (json_body(tensor([4.0], data=[1, 2, 3, 4])), ANY,
                             "non-negative integers, got [4.0]"),
    "dimension as a string": (json_body(tensor(["4"], data=[1, 2, 3, 4])), ANY,
                              "non-negative integers"),
    "dimension as a bool": (json_body(tensor([True], data=[1])), ANY, "non-negative integers"),
    "shape not a list": (json_body(tensor(4, data=[1, 2, 3, 4])), ANY, "non-negative integers"),
    "shape missing": (json_body({"name": "X", "datatype": "FP32", "data": [1]}), ANY,
                      "non-negative integers, got None"),
    # data and datatypes, in JSON
    "datatype not a string": (json_body(tensor([1], 7, data=[1])), ANY, "datatype 7"),
    "data null": (json_body(tensor([1], data=None) | {"data": None}), ANY,
                  "'data' must be a list"),
    "data a number": (json_body(tensor([1], data=5)), ANY, "'data' must be a list"),
    "data an object": (json_body(tensor([1], data={"a": 1})), ANY, "'data' must be a list"),
    "data ragged": (json_body(tensor([2, 2], data=[[1, 2], [3]])), ANY, "rectangular"),
    "data out of range": (json_body(tensor([1], "INT8", data=[1000])),
                          (TensorSpec("X", "INT8", (-1,)),), "list of INT8"),
    "data nested too deep": ((b'{"inputs":[{"name":"X","shape":[1],"datatype":"FP32","data":'
                              + b"[" * 100 + b"1" + b"]" * 100 + b"}]}", None), ANY,
                             "rectangular"),
    "BYTES data not strings": (json_body(tensor([2], "BYTES", data=[1, 2], name="T")), TEXT,
                               "BYTES data must be strings"),
    "BYTES data ragged": (json_body(tensor([2], "BYTES", data=[["a"], "b"], name="T")), TEXT,
                          "BYTES data must be strings"),
    "BOOL data not booleans": (json_body(tensor([1], "BOOL", data=["x"], name="B")), FLAGS,
                               "BOOL data must be true/false"),
    "parameters not an object": (json_body(tensor([1], data=[1.0], parameters=[1])), ANY,
                                 "'parameters' must be a JSON object"),
    "output parameters not an object": (json_body(tensor([1], data=[1.0]),
                                                  outputs=[{"name": "O", "parameters": 3}]),
                                        ANY, "output 'O': 'parameters'"),
    # the binary tensor extension
    "binary: too many dimensions": (binary_body([sized([1] * (MAX_DIMS + 1), 4)], b"\0" * 4),
                                    ANY, "dimensions, more than"),
    "binary: element count overflows": (binary_body([sized([0, 2**62, 4], 0)], b""), ANY,
                                        "describes more elements"),
    "binary: size a bool": (binary_body([sized([1], True)], b"\0" * 4), ANY,
                            "binary_data_size=True must be a non-negative integer"),
    "binary: size a float": (binary_body([sized([1], 4.0)], b"\0" * 4), ANY,
                             "must be a non-negative integer"),
    "binary: size negative": (binary_body([sized([1], -4)], b"\0" * 4), ANY,
                              "must be a non-negative integer"),
    "binary: size not shape x datatype": (binary_body([sized([2], 4)], b"\0" * 4), ANY,
                                          "needs 8 bytes, binary_data_size is 4"),
    "binary: bytes missing": (binary_body([sized([2], 8)], b"\0" * 4), ANY,
                              "does not fit the 4 bytes left"),
    "binary: bytes left over": (binary_body([sized([1], 4)], b"\0" * 8), ANY,
                                "4 bytes after the binary data"),
    "binary: size without the header": (json_body(sized([1], 4)), ANY,
                                        "no Inference-Header-Content-Length"),
    "binary: header length past the body": ((b'{"inputs": []}', "999"), ANY,
                                            "does not fit a body"),
    "binary: header length not a number": ((b'{"inputs": []}', "ten"), ANY, "not an integer"),
    "binary BYTES: element overruns": (binary_body([sized([1], 8, "BYTES", "T")],
                                                   (100).to_bytes(4, "little") + b"abcd"),
                                       TEXT, "says it has 100 bytes"),
    "binary BYTES: truncated length": (binary_body([sized([2], 6, "BYTES", "T")],
                                                   strings(b"") + b"\0\0"), TEXT, "truncated"),
    "binary BYTES: more elements than the shape": (
        binary_body([sized([1], 400, "BYTES", "T")], b"\0" * 400), TEXT,
        "more than the 1 BYTES elements"),
    "binary BYTES: fewer elements than the shape": (
        binary_body([sized([3], 10, "BYTES", "T")], strings(b"ab", b"")), TEXT,
        "needs 3 BYTES elements, the binary data holds 2"),
    "binary BYTES: zero dims, huge shape": (binary_body([sized([0, 2**62, 8], 0, "BYTES", "T")],
                                                        b""), TEXT, "describes more elements"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_malformed_body_is_a_client_error_naming_the_problem(case):
    (raw, header), specs, fragment = CASES[case]
    with pytest.raises(BatchScopeError) as info:
        parse_infer(raw, header, "m", specs, OUTPUTS, 3)
    assert isinstance(info.value, ClientError)
    assert info.value.http_status == 400
    assert fragment in info.value.message, info.value.message


def test_the_limits_still_accept_what_they_bound():
    deep = (TensorSpec("X", "FP32", (-1,) * (MAX_DIMS - 1)),)
    req = parse_infer(*json_body(tensor([1] * MAX_DIMS, data=[2.0])), "m", deep, OUTPUTS, 3)
    assert req.inputs["X"].shape == (1,) * (MAX_DIMS - 1)  # the leading 1 is the batch
    zero = parse_infer(*json_body(tensor([0, 2**20], data=[])), "m",
                       (TensorSpec("X", "FP32", (-1, -1)),), OUTPUTS, 3)
    assert zero.inputs["X"].shape == (0, 2**20)
    raw, header = binary_body([sized([2], 8), sized([3], 15, "BYTES", "T")],
                              b"\0" * 8 + strings(b"ab", b"", b"c"))
    both = parse_infer(raw, header, "m", ANY + TEXT, OUTPUTS, 3)
    assert list(both.inputs["T"]) == [b"ab", b"", b"c"] and both.inputs["X"].shape == (2,)
    flags = parse_infer(*json_body(tensor([2], "BOOL", data=[True, False], name="B")), "m",
                        FLAGS, OUTPUTS, 3)
    assert flags.inputs["B"].dtype == bool and list(flags.inputs["B"]) == [True, False]


@pytest.mark.slow
def test_the_server_answers_every_case_with_a_400_json_error():
    """Through the real server (fast path): no 500, no traceback in the body."""
    import socket

    from runtime.api.config import BatchingConfig, ServerConfig
    from runtime.models.toys import DoubleModel
    from runtime.server.service import Service, ServiceThread

    svc = Service({"double": DoubleModel()}, {"double": BatchingConfig(max_batch_size=8)},
                  ServerConfig(record=False), instance_id="kserve-limits")
    runner = ServiceThread(svc)
    url = runner.start()
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20.0) as sock:
            reader = sock.makefile("rb")
            for case, ((raw, header), _, _) in CASES.items():
                extra = f"Inference-Header-Content-Length: {header}\r\n" if header else ""
                sock.sendall((f"POST /v2/models/double/infer HTTP/1.1\r\nHost: x\r\n{extra}"
                              f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw)
                status = int(reader.readline().split()[1])
                length = 0
                while (line := reader.readline()) != b"\r\n":
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                doc = orjson.loads(reader.read(length))
                assert status == 400, (case, doc)
                assert set(doc) == {"error"} and "Traceback" not in doc["error"], case
    finally:
        runner.stop()
