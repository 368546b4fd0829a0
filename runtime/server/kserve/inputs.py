"""One input of an ``/infer`` request: what its entry declares (name, shape, datatype,
where its values are), checked against the model's spec and the request's bounds before
any value is read, then its values as a numpy array (from JSON ``data`` or binary tensor
bytes)."""

from __future__ import annotations

import math
import struct
from collections import deque
from functools import reduce
from operator import countOf, iadd
from typing import Any, NamedTuple, Sequence

import numpy as np
import orjson

from runtime.api.errors import ClientError, ValidationError
from runtime.api.model import DATATYPES, TensorSpec
from runtime.server.bounds import (ITEM_BYTES, MAX_REQUEST_ITEMS, RequestBounds, itemsize,
                                   tensor_bytes)

#: the most dimensions a tensor may have (numpy's own limit)
MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
#: the most elements a shape may describe, its zero dimensions counted as 1 (more than
#: any request body holds, at one byte an element: a larger span declares work, such as
#: a batch of 2**32 empty items, that no data backs)
MAX_ELEMENTS = 1 << 27

#: the ``struct`` code of each numeric datatype, in standard size and native byte order
#: (``=``): packing JSON values with it checks each one's type and range in C, where
#: ``np.fromiter``/``np.asarray`` would truncate floats to integers, parse numeric
#: strings, take true/false for 1/0, and turn a float beyond FP32/FP16 into inf
_CODES = {"UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT8": "b", "INT16": "h",
          "INT32": "i", "INT64": "q", "FP16": "e", "FP32": "f", "FP64": "d"}
_INTEGER_CODES = frozenset("BHIQbhiq")
#: values packed by one call at most (a large input is packed in parts of this many)
_PACK_AT_ONCE = 1 << 16
#: a 0-d 1 of each FP datatype (comparing with it is cheaper than with a Python 1)
_ONES = {t: np.ones((), DATATYPES[t]) for t in ("FP16", "FP32", "FP64")}
assert all(struct.calcsize("=" + c) == np.dtype(DATATYPES[t]).itemsize for t, c in _CODES.items())


def shape_of(name: str, shape: Any) -> tuple[int, ...]:
    """Input ``name``'s shape as sent (a list of non-negative integers), checked."""
    if type(shape) is list and len(shape) <= MAX_DIMS:
        span = 1
        for d in shape:
            if type(d) is not int or d < 0:
                break
            if d:
                span *= d
        else:
            if span > MAX_ELEMENTS:
                raise ClientError(f"input {name!r}: shape {shape} describes more elements "
                                  f"than a tensor may have ({MAX_ELEMENTS}); send the shape "
                                  "of the data actually sent")
            return tuple(shape)
    if type(shape) is list and len(shape) > MAX_DIMS:
        raise ClientError(f"input {name!r}: shape has {len(shape)} dimensions, more than the "
                          f"{MAX_DIMS} a tensor may have")
    raise ClientError(f"input {name!r}: 'shape' must be a list of non-negative integers, "
                      f"got {_quote(shape)}")


def _quote(value: Any) -> str:
    """``repr`` of a value from the request, cut short for an error message."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def bytes_from_binary(name: str, raw: bytes, count: int) -> np.ndarray:
    """BYTES tensors in binary form: each element is a 4-byte little-endian length + bytes."""
    items: list[bytes] = []
    pos = 0
    end = len(raw)
    while pos < end:
        if len(items) == count:
            raise ClientError(f"input {name!r}: the binary data holds more than the {count} "
                              "BYTES elements its shape needs; send exactly one 4-byte length "
                              "and its bytes per element")
        if pos + 4 > end:
            raise ClientError(f"input {name!r}: truncated BYTES element in the binary data")
        n = int.from_bytes(raw[pos:pos + 4], "little")
        if pos + 4 + n > end:
            raise ClientError(f"input {name!r}: BYTES element {len(items)} says it has {n} "
                              f"bytes, the binary data has {end - pos - 4} left")
        items.append(bytes(raw[pos + 4:pos + 4 + n]))
        pos += 4 + n
    if len(items) != count:
        raise ClientError(f"input {name!r}: shape needs {count} BYTES elements, the binary "
                          f"data holds {len(items)}")
    arr = np.empty(count, dtype=object)
    arr[:] = items
    return arr


class _Input(NamedTuple):
    """One entry of ``inputs`` as declared, checked before its values are read."""

    entry: dict
    name: str
    shape: tuple[int, ...]
    datatype: str
    np_dtype: Any
    count: int
    #: ``binary_data_size``, or None for values in ``data``
    size: int | None


def _declared(t: Any, index: int, binary: memoryview | None, offset: int) -> tuple[_Input, int]:
    """What one entry of ``inputs`` declares (name, shape, datatype, where its values
    are); returns it and the binary offset after it. Reads no values."""
    if not isinstance(t, dict):
        raise ClientError(f"inputs[{index}] must be an object with name, shape, datatype and data")
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise ClientError(f"inputs[{index}] needs a 'name' string")
    shape = shape_of(name, t.get("shape"))
    datatype = t.get("datatype")
    np_dtype = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if np_dtype is None:
        raise ClientError(f"input {name!r}: datatype {datatype!r} is not supported; use one of "
                          f"{', '.join(DATATYPES)}")
    count = math.prod(shape)
    params = t.get("parameters")
    if params is None:
        size = None
    elif type(params) is dict:
        size = params.get("binary_data_size")
    else:
        raise ClientError(f"input {name!r}: 'parameters' must be a JSON object, got "
                          f"{_quote(params)}")
    if size is not None:
        if binary is None:
            raise ClientError(f"input {name!r} has binary_data_size but the request carries no "
                              "Inference-Header-Content-Length header")
        if type(size) is not int or size < 0:
            raise ClientError(f"input {name!r}: binary_data_size={_quote(size)} must be a "
                              "non-negative integer (bytes)")
        if offset + size > len(binary):
            raise ClientError(f"input {name!r}: binary_data_size={size!r} does not fit the "
                              f"{len(binary) - offset} bytes left in the body")
        if datatype != "BYTES":
            itemsize = np.dtype(np_dtype).itemsize
            if size != count * itemsize:
                raise ClientError(f"input {name!r}: shape {list(shape)} of {datatype} needs "
                                  f"{count * itemsize} bytes, binary_data_size is {size}")
        offset += size
    elif "data" not in t:
        raise ClientError(f"input {name!r} has no 'data' (send the values as a flat or nested "
                          "list, or use the binary tensor extension)")
    elif type(t["data"]) is not list:
        raise ClientError(f"input {name!r}: 'data' must be a list (flat or nested) of "
                          f"{datatype} values, got {_quote(t['data'])}")
    return _Input(t, name, shape, datatype, np_dtype, count, size), offset


def check_declared(model: str, specs: Sequence[TensorSpec], name: str,
                   shape: tuple[int, ...], bounds: RequestBounds) -> int:
    """Check one input's declared shape against the model's spec for it and ``bounds``
    before any of its values are read (time independent of the sizes declared);
    returns its batch dimension, or -1 when it is sent without one."""
    spec = None
    for s in specs:
        if s.name == name:
            spec = s
            break
    if spec is None:
        raise ClientError(f"model {model!r} has no input(s) {[name]}; its inputs are "
                          f"{[s.name for s in specs]}")
    want = spec.shape
    item = shape
    k = -1
    if len(shape) == len(want) + 1:
        k = shape[0]
        item = shape[1:]
    if item != want and (len(item) != len(want) or any(
            w != -1 and w != g for w, g in zip(want, item))):
        raise ClientError(f"input {name!r} must have shape {list(want)}, or "
                          f"{_shape_text(['k', *want])} for a batch of k items "
                          f"(-1 = any size), got {list(shape)}")
    if k > bounds.max_items:
        raise ValidationError(
            f"a request to model {model!r} holds {k} items; send 1 to {bounds.max_items} per "
            f"request (input {name!r} has a batch dimension of {k}; at most the model's "
            f"max_queue_size and {MAX_REQUEST_ITEMS}), splitting larger batches into several "
            "requests")
    most = bounds.max_length
    if most is not None:
        for w, g in zip(want, item):
            if w == -1 and g > most:
                raise ValidationError(
                    f"input {name!r} is {g} long along a variable dimension; model {model!r} "
                    f"accepts at most {most} (max_length); send shorter inputs")
    return k


def declared_bytes(inputs: Sequence[tuple[str, int, int]], items: int) -> int:
    """What a request's arrays will hold: ``(datatype, count, raw bytes)`` per input
    and ``items`` items (see ``runtime.server.bounds``)."""
    total = items * ITEM_BYTES
    for datatype, count, raw in inputs:
        total += tensor_bytes(itemsize(DATATYPES[datatype]), count, raw)
    return total


def _values(d: _Input, binary: memoryview | None, offset: int) -> np.ndarray:
    """The array of a declared input (binary values start at ``offset``)."""
    name, shape, datatype, np_dtype, count = d.name, d.shape, d.datatype, d.np_dtype, d.count
    if d.size is not None:
        assert binary is not None
        raw = bytearray(binary[offset:offset + d.size])  # writable: torch.from_numpy wants that
        if datatype == "BYTES":
            arr = bytes_from_binary(name, raw, count)
        else:
            arr = np.frombuffer(raw, dtype=np_dtype)
        return arr.reshape(shape)
    data = d.entry["data"]
    if datatype in _CODES:
        if data and type(data[0]) is list:
            flat = _flattened(d, data)
            nested = True
        else:
            flat = data
            nested = False
        if len(flat) != count:  # nothing converted for values that cannot fit
            raise ClientError(f"input {name!r}: shape {list(shape)} needs {count} values, "
                              f"data has {len(flat)}")
        arr = _numbers(d, flat, nested)
        return arr if arr.shape == shape else arr.reshape(shape)
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=object).reshape(-1)
            for v in flat:
                if type(v) is not str:
                    raise ClientError(f"input {name!r}: BYTES data must be strings (or a "
                                      f"rectangular nested list of them), got {_quote(v)}")
            arr = np.empty(flat.size, dtype=object)
            arr[:] = [v.encode() for v in flat]
        else:  # BOOL
            arr = np.asarray(data)
            if arr.size and arr.dtype != np.bool_:
                raise ClientError(f"input {name!r}: BOOL data must be true/false values, got "
                                  f"{arr.dtype.name} values")
            arr = arr.astype(np.bool_, copy=False)
    except (ValueError, TypeError, OverflowError):
        raise ClientError(f"input {name!r}: data is not a (rectangular) list of {datatype} "
                          "values") from None
    if arr.size != count:
        raise ClientError(f"input {name!r}: shape {list(shape)} needs {count} values, "
                          f"data has {arr.size}")
    return arr if arr.shape == shape else arr.reshape(shape)


def _flattened(d: _Input, data: list) -> list:
    """A nested ``data`` list's values in row-major order; at every level it must be a
    list of lists of one length (rectangular), at most ``MAX_DIMS`` deep."""
    depth = 1
    while data and type(data[0]) is list:
        depth += 1
        if depth > MAX_DIMS:
            raise ClientError(f"input {d.name!r}: data is not a (rectangular) list of "
                              f"{d.datatype} values: it is nested more than {MAX_DIMS} deep, "
                              "the most dimensions a tensor may have")
        if len(data) == 1:  # [[...]]: a batch of one
            data = data[0]
            continue
        if set(map(type, data)) != {list} or len(set(map(len, data))) != 1:
            raise ClientError(f"input {d.name!r}: data is not a (rectangular) list of "
                              f"{d.datatype} values: lists at one nesting level differ in "
                              "length, or mix lists and values; send a flat list, or nested "
                              "lists of one length per level")
        data = reduce(iadd, data, [])
    return data


def _numbers(d: _Input, flat: list, nested: bool) -> np.ndarray:
    """``flat`` (a list of JSON values) as a 1-D array of ``d``'s numeric datatype, each
    value checked: integers (not floats, strings, true/false or null) for the INT and
    UINT types, numbers (integers or floats, not strings, true/false or null) for the FP
    types, and every value within the datatype's range."""
    n = len(flat)
    arr = np.empty(n, d.np_dtype)
    if not n:
        return arr
    code = _CODES[d.datatype]
    try:  # in C: refuses strings, null, lists, floats for integers, values out of range
        if n <= _PACK_AT_ONCE:
            struct.pack_into(f"={n}{code}", arr, 0, *flat)
        else:  # in parts: the arguments of one call are a tuple as long as the data
            size = arr.itemsize
            for i in range(0, n, _PACK_AT_ONCE):
                part = flat[i:i + _PACK_AT_ONCE]
                struct.pack_into(f"={len(part)}{code}", arr, i * size, *part)
    except (struct.error, TypeError, OverflowError, ValueError):
        raise _bad_value(d, flat, nested) from None
    # what it takes that it should not: true and false, packed as 1 and 0 (for the FP
    # types, looked for only where the array holds a 0 or a 1)
    if ((code in _INTEGER_CODES or np.count_nonzero(arr) != n
         or np.count_nonzero(arr == _ONES[d.datatype])) and _holds_bool(flat)):
        raise _bad_value(d, flat, nested)
    return arr


def _holds_bool(flat: list) -> bool:
    """Whether a list of numbers holds a ``True`` or ``False`` (exactly), quickly for a
    list of integers or a list of floats."""
    if type(flat[0]) is int:  # serializing integers is quicker than looking at each type
        try:
            text = orjson.dumps(flat)
        except orjson.JSONEncodeError:  # an int beyond 64 bits
            pass
        else:  # no integer is written with an e; true, false and some floats are
            if b"e" not in text:
                return False
    else:
        try:  # float.conjugate takes nothing but a float: not a bool, nor an int
            deque(map(float.conjugate, flat), 0)
            return False
        except TypeError:
            pass
    return countOf(map(type, flat), bool) != 0


def _bad_value(d: _Input, flat: list, nested: bool) -> ClientError:
    """The error naming the first value of ``flat`` that ``d``'s datatype cannot hold."""
    name, datatype = d.name, d.datatype
    code = _CODES[datatype]
    one = struct.Struct("=" + code)
    integers = code in _INTEGER_CODES
    if integers:
        info = np.iinfo(d.np_dtype)
        span = f"integers from {info.min} to {info.max}"
        kind = ("integers (JSON numbers without a fraction or exponent; not strings, "
                "true/false or null)")
    else:
        most = float(np.finfo(d.np_dtype).max)
        span = f"numbers from {-most:.8g} to {most:.8g}"
        kind = "JSON numbers (not strings, true/false or null)"
    for i, v in enumerate(flat):
        t = type(v)
        if t is int or (t is float and not integers):
            try:
                one.pack(v)
                continue
            except (struct.error, OverflowError, ValueError):
                wrong_type = False
        elif integers and t is float and v.is_integer():
            # a JSON integer past 64 bits is parsed as a float (rounded): say so
            try:
                one.pack(int(v))
                wrong_type = -2.0**63 < v < 2.0**64
            except (struct.error, OverflowError, ValueError):
                wrong_type = False
        else:
            wrong_type = True
        where = f"element {i}" + (" of the data flattened in row-major order" if nested else "")
        shown = _quote(v) if v is not None and t is not bool else orjson.dumps(v).decode()
        if t is list:
            return ClientError(f"input {name!r}: data is not a (rectangular) list of "
                               f"{datatype} values: {where} is a list where a value is "
                               "expected; send a flat list, or nested lists of one depth")
        if not wrong_type:
            return ClientError(f"input {name!r}: data is not a list of {datatype} values: "
                               f"{where} is {shown}, out of range for {datatype} "
                               f"({span}); send values within that range")
        return ClientError(f"input {name!r}: data is not a (rectangular) list of {datatype} "
                           f"values: {datatype} data must be {kind}; {where} is {shown}")
    return ClientError(f"input {name!r}: data is not a (rectangular) list of {datatype} values")


def _shape_text(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
