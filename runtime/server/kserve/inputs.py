"""One input of an ``/infer`` request: what its entry declares (name, shape, datatype,
where its values are), checked against the model's spec and the request's bounds before
any value is read, then its values as a numpy array (from JSON ``data`` or binary tensor
bytes)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np

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
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=object).reshape(-1)
            for v in flat:
                if type(v) is not str:
                    raise ClientError(f"input {name!r}: BYTES data must be strings (or a "
                                      f"rectangular nested list of them), got {_quote(v)}")
            arr = np.empty(flat.size, dtype=object)
            arr[:] = [v.encode() for v in flat]
        elif datatype == "BOOL":
            arr = np.asarray(data)
            if arr.size and arr.dtype != np.bool_:
                raise ClientError(f"input {name!r}: BOOL data must be true/false values, got "
                                  f"{arr.dtype.name} values")
            arr = arr.astype(np.bool_, copy=False)
        elif data and type(data[0]) is not list:
            if len(data) != count:  # nothing converted for values that cannot fit
                raise ClientError(f"input {name!r}: shape {list(shape)} needs {count} values, "
                                  f"data has {len(data)}")
            try:  # a flat list of numbers: the common case, converted without a detour
                arr = np.fromiter(data, np_dtype, len(data))
            except (ValueError, TypeError, OverflowError):
                arr = np.asarray(data, dtype=np_dtype)
        else:
            arr = np.asarray(data, dtype=np_dtype)
    except (ValueError, TypeError, OverflowError):
        raise ClientError(f"input {name!r}: data is not a (rectangular) list of {datatype} "
                          "values") from None
    if arr.size != count:
        raise ClientError(f"input {name!r}: shape {list(shape)} needs {count} values, "
                          f"data has {arr.size}")
    return arr if arr.shape == shape else arr.reshape(shape)


def _shape_text(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
