"""The values of a KServe v2 JSON ``data`` list are taken as sent or refused, never coerced.

Numeric datatypes follow JSON types the way Triton does: the INT/UINT types take integers
only (not 1.9, not 2.0, not "2", not true), the FP types take numbers only (integers
or floats, not "1e5", not "nan", not true), and every value must fit the datatype (300
is no UINT8, 1e39 no FP32, 70000 no FP16), or the request is a 400 that names the
input, says what the datatype takes and shows the first bad value. Valid values, flat
or nested, decode to exactly what numpy makes of them. Then the same through the real
server: 400 ``{"error": ...}`` for bad values, exact answers for good ones.
"""

from __future__ import annotations

import random

import numpy as np
import orjson
import pytest
import torch

from runtime.api.errors import ClientError
from runtime.api.model import DATATYPES, ModelAPI, TensorSpec
from runtime.server.kserve import parse_infer

NUMERIC = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
           "FP16", "FP32", "FP64")
INTEGERS = NUMERIC[:8]
FLOATS = NUMERIC[8:]


def parse_raw(raw: bytes, datatype: str, dims: int = 1):
    """``raw`` decoded for a model whose input X has ``dims`` dimensions of any size."""
    return parse_infer(raw, None, "m", (TensorSpec("X", datatype, (-1,) * dims),),
                       (TensorSpec("O", "FP32", (-1,)),), 3)


def body(datatype: str, data, shape=None) -> bytes:
    shape = [len(data)] if shape is None else shape
    return orjson.dumps({"inputs": [{"name": "X", "shape": shape, "datatype": datatype,
                                     "data": data}]})


def decode(datatype: str, data, shape=None) -> np.ndarray:
    dims = 1 if shape is None else len(shape)
    return parse_raw(body(datatype, data, shape), datatype, dims).inputs["X"]


def refusal(datatype: str, data, shape=None, raw: bytes | None = None) -> str:
    dims = 1 if shape is None else len(shape)
    with pytest.raises(ClientError) as info:
        parse_raw(raw if raw is not None else body(datatype, data, shape), datatype, dims)
    assert info.value.http_status == 400
    assert "input 'X'" in info.value.message
    return info.value.message


# -- refused: the wrong JSON type ---------------------------------------------------

@pytest.mark.parametrize("datatype", INTEGERS)
@pytest.mark.parametrize("data, shown", [
    ([1.9, "2", 3.7], "element 0 is 1.9"),
    ([1, 2.0, 3], "element 1 is 2.0"),  # a float, however whole: Triton refuses it too
    ([1, "2", 3], "element 1 is '2'"),
    ([1, 2, True], "element 2 is true"),
    ([False, 1, 2], "element 0 is false"),
    ([1, None], "element 1 is null"),
    ([1, {"a": 1}], "element 1 is {'a': 1}"),
])
def test_integer_types_take_only_json_integers(datatype, data, shown):
    message = refusal(datatype, data)
    assert f"{datatype} data must be integers" in message, message
    assert shown in message, message


@pytest.mark.parametrize("datatype", FLOATS)
@pytest.mark.parametrize("data, shown", [
    (["1e5"], "element 0 is '1e5'"),
    ([1.5, "nan"], "element 1 is 'nan'"),
    ([1.5, 2.5, "inf"], "element 2 is 'inf'"),
    ([0.5, True], "element 1 is true"),
    ([False, 0.5], "element 0 is false"),
    ([1, 2, True], "element 2 is true"),  # among integers (valid FP values) too
    ([1.5, None], "element 1 is null"),
])
def test_fp_types_take_only_json_numbers(datatype, data, shown):
    message = refusal(datatype, data)
    assert f"{datatype} data must be JSON numbers" in message, message
    assert shown in message, message


def test_a_bool_among_many_floats_and_zeros_is_found():
    data = [0.0, 1.0, 0.25] * 100
    data[257] = False
    message = refusal("FP32", data)
    assert "element 257 is false" in message, message
    data[257] = 1.0
    assert decode("FP32", data).dtype == np.float32


def test_the_message_says_what_to_send():
    message = refusal("INT64", [1.9, "2", 3.7])
    assert message == ("input 'X': data is not a (rectangular) list of INT64 values: INT64 "
                       "data must be integers (JSON numbers without a fraction or exponent; "
                       "not strings, true/false or null); element 0 is 1.9")


# -- refused: out of the datatype's range ----------------------------------------------

@pytest.mark.parametrize("datatype, data, shown, span", [
    ("UINT8", [1, 300], "element 1 is 300", "integers from 0 to 255"),
    ("UINT8", [-1], "element 0 is -1", "integers from 0 to 255"),
    ("INT8", [-129], "element 0 is -129", "integers from -128 to 127"),
    ("INT8", [1000], "element 0 is 1000", "integers from -128 to 127"),
    ("UINT16", [65536], "element 0 is 65536", "integers from 0 to 65535"),
    ("INT16", [-32769], "element 0 is -32769", "integers from -32768 to 32767"),
    ("UINT32", [2**32], "element 0 is 4294967296", "integers from 0 to 4294967295"),
    ("INT32", [2**31], "element 0 is 2147483648", "integers from -2147483648 to 2147483647"),
    ("INT64", [2**63], "element 0 is 9223372036854775808",
     "integers from -9223372036854775808 to 9223372036854775807"),
    ("UINT64", [-1], "element 0 is -1", "integers from 0 to 18446744073709551615"),
    ("FP32", [1.0, 1e39], "element 1 is 1e+39", "numbers from -3.4028235e+38 to 3.4028235e+38"),
    ("FP32", [-3.5e38], "element 0 is -3.5e+38", "numbers from -3.4028235e+38 to"),
    ("FP16", [70000.0], "element 0 is 70000.0", "numbers from -65504 to 65504"),
    ("FP16", [65520], "element 0 is 65520", "numbers from -65504 to 65504"),
])
def test_values_out_of_range_are_refused(datatype, data, shown, span):
    message = refusal(datatype, data)
    assert f"out of range for {datatype} ({span}" in message, message
    assert shown in message, message
    assert "send values within that range" in message


@pytest.mark.parametrize("datatype, raw", [
    # JSON integers past 64 bits: orjson reads them as (rounded) floats
    ("UINT64", b"18446744073709551616"),
    ("INT64", b"-9223372036854775809"),
    ("INT64", b"100000000000000000000000000000000"),
])
def test_integers_past_64_bits_are_out_of_range(datatype, raw):
    message = refusal(datatype, None, raw=b'{"inputs": [{"name": "X", "shape": [1], '
                      b'"datatype": "' + datatype.encode() + b'", "data": [' + raw + b"]}]}")
    assert f"out of range for {datatype}" in message, message


def test_python_json_big_ints_are_a_400_not_an_overflow():
    """``_values`` given ints past 64 bits (as Python's json would read them)."""
    from runtime.server.kserve.inputs import _declared, _values
    for datatype, v in (("INT64", 2**70), ("UINT64", 2**64), ("FP16", 2**70), ("FP64", 10**400)):
        d, _ = _declared({"name": "X", "shape": [2], "datatype": datatype, "data": [1, v]},
                         0, None, 0)
        with pytest.raises(ClientError, match=f"element 1 is {str(v)[:50]}.*out of range "
                                              f"for {datatype}"):
            _values(d, None, 0)


# -- nested data: the same rules ---------------------------------------------------

@pytest.mark.parametrize("datatype, data, shape, fragment", [
    ("INT64", [[1, 2], [3, 4.5]], [2, 2],
     "element 3 of the data flattened in row-major order is 4.5"),
    ("INT64", [[1, 2, True]], [1, 3], "element 2 of the data flattened in row-major order is true"),
    ("FP32", [[1.0, "2"], [3.0, 4.0]], [2, 2],
     "element 1 of the data flattened in row-major order is '2'"),
    ("FP32", [[0.5, 1e39]], [1, 2], "element 1 of the data flattened in row-major order is 1e+39"),
    ("UINT8", [[[1], [256]]], [1, 2, 1],
     "element 1 of the data flattened in row-major order is 256"),
    ("FP32", [[1, 2], [3]], [2, 2], "lists at one nesting level differ in length"),
    ("FP32", [[1, 2], 3], [2, 2], "mix lists and values"),
    ("FP32", [[1, 2], [3, [4]]], [2, 2],
     "element 3 of the data flattened in row-major order is a list"),
    ("FP32", [1.0, [2.0]], [2], "element 1 is a list where a value is expected"),
])
def test_nested_data_follows_the_same_rules(datatype, data, shape, fragment):
    message = refusal(datatype, data, shape)
    assert fragment in message, message
    assert f"list of {datatype} values" in message


def test_data_nested_deeper_than_a_tensor_may_be_is_refused():
    data: list = [1.0]
    for _ in range(80):
        data = [data]
    assert "rectangular" in refusal("FP32", data, shape=[1])


# -- accepted: exactly the values sent ----------------------------------------------

def test_integer_types_take_their_whole_range_exactly():
    for datatype in INTEGERS:
        info = np.iinfo(DATATYPES[datatype])
        data = [info.min, info.min + 1, -1 if info.min else 0, 0, 1, 2, info.max - 1, info.max]
        arr = decode(datatype, data)
        assert arr.dtype == DATATYPES[datatype]
        assert arr.tolist() == data
    big = [2**62 + 1, -(2**62) - 1, 9007199254740993]  # beyond float64's integers
    assert decode("INT64", big).tolist() == big


def test_fp_types_take_ints_and_floats_as_numpy_rounds_them():
    rng = random.Random(7)
    for datatype in FLOATS:
        most = 60000 if datatype == "FP16" else 2**60
        floats = [rng.uniform(-6e4, 6e4) for _ in range(300)] + [0.0, -0.0, 1.0, 5e-324, 1e-40,
                                                                  6e-8, 1e-5]
        ints = [rng.randrange(-most, most) for _ in range(100)] + [0, 1, -1, most - 1]
        mixed = floats + ints
        rng.shuffle(mixed)
        for data in (floats, ints, mixed, [1, 2, 3, 4], [0.5, 1.5]):
            arr = decode(datatype, data)
            want = np.array(data, dtype=np.float64).astype(DATATYPES[datatype])
            assert arr.dtype == DATATYPES[datatype]
            assert arr.tobytes() == want.tobytes(), datatype  # bit for bit, -0.0 kept
    assert decode("FP32", [3.4028235e38, -3.4028235e38]).tolist() == [3.4028234663852886e38,
                                                                       -3.4028234663852886e38]
    assert decode("FP16", [65504, -65504.0, 65519.0]).tolist() == [65504.0, -65504.0, 65504.0]
    assert decode("FP64", [1.7976931348623157e308]).tolist() == [1.7976931348623157e308]


def test_fp32_with_ints_like_a_javascript_client_sends():
    arr = decode("FP32", [1, 0, 255, -3])
    assert arr.dtype == np.float32 and arr.tolist() == [1.0, 0.0, 255.0, -3.0]


def test_nested_data_decodes_to_the_flat_values_in_their_shape():
    rows = [[0.5, 1.0, 2.0, -3.0], [4.0, 0.0, 6.25, 7.0]]
    arr = decode("FP32", rows, shape=[2, 4])
    assert arr.shape == (2, 4) and arr.dtype == np.float32
    np.testing.assert_array_equal(arr, np.array(rows, dtype=np.float32))
    one = decode("INT64", [[5, 6, 7]], shape=[1, 3])
    assert one.shape == (1, 3) and one.tolist() == [[5, 6, 7]]
    cube = [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    assert decode("UINT8", cube, shape=[2, 2, 2]).tolist() == cube
    # nested otherwise than the shape, the same number of values: reshaped, as before
    assert decode("FP32", [[1, 2], [3, 4]], shape=[4]).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert decode("FP32", [[]], shape=[1, 0]).shape == (1, 0)
    assert decode("FP32", [], shape=[0]).shape == (0,)


def test_value_counts_are_still_checked_before_values():
    assert "needs 4 values, data has 3" in refusal("FP32", [1.0, 2.0, "x"], shape=[4])
    assert "needs 4 values, data has 2" in refusal("INT64", [[1], [2]], shape=[4])


def test_the_arrays_are_writable_and_own_their_memory():
    """(torch.from_numpy wants a writable array)."""
    for datatype, data in (("FP32", [0.5, 1.5]), ("INT64", [1, 2]), ("FP32", [[1.0, 2.0]])):
        arr = decode(datatype, data, shape=[1, 2] if type(data[0]) is list else None)
        assert arr.flags.writeable
        torch.from_numpy(arr)


def test_bool_and_bytes_are_unchanged():
    assert decode("BOOL", [True, False]).tolist() == [True, False]
    assert "BOOL data must be true/false" in refusal("BOOL", [1, 0])
    assert decode("BYTES", ["a", "bc"]).tolist() == [b"a", b"bc"]
    assert "BYTES data must be strings" in refusal("BYTES", ["a", 1])


# -- through the real server ---------------------------------------------------------

class IdsModel(ModelAPI):
    """Four INT64 ids in, each plus one out."""

    name = "ids"
    inputs = (TensorSpec("IDS", "INT64", (4,)),)
    outputs = (TensorSpec("NEXT", "INT64", (4,)),)

    def decode(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return inputs["IDS"].reshape(4)

    def collate(self, items: list[np.ndarray], pad_to: int | None) -> torch.Tensor:
        return torch.from_numpy(np.stack(items))

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        return batch + 1

    def split(self, output: torch.Tensor, n: int) -> list[dict[str, np.ndarray]]:
        out = output.numpy()
        return [{"NEXT": out[i]} for i in range(n)]


@pytest.mark.slow
def test_the_server_refuses_bad_values_with_a_400_and_answers_good_ones_exactly():
    import httpx

    from runtime.api.config import BatchingConfig, ServerConfig
    from runtime.models.toys import DoubleModel
    from runtime.server.service import Service, ServiceThread

    svc = Service({"double": DoubleModel(), "ids": IdsModel()},
                  {"double": BatchingConfig(max_batch_size=8),
                   "ids": BatchingConfig(max_batch_size=8)},
                  ServerConfig(record=False), instance_id="kserve-json-values")
    runner = ServiceThread(svc)
    url = runner.start()

    def infer(model: str, name: str, datatype: str, data, shape=(4,)):
        doc = {"inputs": [{"name": name, "shape": list(shape), "datatype": datatype,
                           "data": data}]}
        r = http.post(f"/v2/models/{model}/infer", content=orjson.dumps(doc),
                      headers={"content-type": "application/json"})
        return r.status_code, r.json()

    try:
        with httpx.Client(base_url=url, timeout=20.0) as http:
            bad = [
                ("ids", "IDS", "INT64", [1.9, "2", 3.7, 4], "INT64 data must be integers"),
                ("ids", "IDS", "INT64", [1, 2, 3, True], "element 3 is true"),
                ("ids", "IDS", "INT64", [1, 2, 3, 2**63], "out of range for INT64"),
                ("double", "INPUT0", "FP32", [1.0, 2.0, 3.0, 1e39], "out of range for FP32"),
                ("double", "INPUT0", "FP32", [1.0, "1e5", 3.0, 4.0], "must be JSON numbers"),
                ("double", "INPUT0", "FP32", [1.0, 0.0, False, 4.0], "element 2 is false"),
            ]
            for model, name, datatype, data, fragment in bad:
                status, doc = infer(model, name, datatype, data)
                assert status == 400, (data, doc)
                assert set(doc) == {"error"} and fragment in doc["error"], doc
                assert f"input '{name}'" in doc["error"]
            status, doc = infer("ids", "IDS", "INT64", [0, 1, 2**53 + 1, 2**62])
            assert status == 200, doc
            assert doc["outputs"][0]["data"] == [1, 2, 2**53 + 2, 2**62 + 1]
            status, doc = infer("double", "INPUT0", "FP32", [1, 0.5, 0, -3.25])
            assert status == 200, doc
            assert doc["outputs"][0]["data"] == [2.0, 1.0, 0.0, -6.5]
            status, doc = infer("double", "INPUT0", "FP32", [[1, 0.5, 0, 3.0]], shape=(1, 4))
            assert status == 200, doc
            assert doc["outputs"][0]["data"] == [2.0, 1.0, 0.0, 6.0]
    finally:
        runner.stop()
