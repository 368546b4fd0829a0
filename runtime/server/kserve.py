"""Open Inference Protocol (KServe v2 REST) codec: bytes <-> numpy tensors.

Pure functions, no I/O (the two engine calls at the end aside). The request side
turns an ``/infer`` body (JSON, or JSON followed by raw tensor bytes when the client
uses the binary tensor extension) into one request's named numpy arrays plus its
scheduling parameters, checking every tensor against the model's ``TensorSpec``s. The
response side turns the model's output arrays back into a v2 response body.

Scheduling parameters follow Triton's schedule-policy extension: ``priority`` is
1 (most urgent) .. ``priority_levels``, with 0 or absent meaning the model's
default; ``timeout`` is in microseconds, 0 or absent meaning the default. The
runtime's own priorities run from 0, so HTTP priority ``p`` is engine priority
``p - 1``. ``realtime: true`` (or ``bypass: true``) asks for the bypass lane.

A batch dimension, as Triton's batching models have: every input sent with one more
dimension than its ``TensorSpec`` (``[k, ...]``, the same ``k >= 1`` for all) makes a
request of ``k`` items (``InferRequest.items``; one item when ``k`` is 1), answered
with every output stacked in item order (``[k, ...]``). Inputs sent as the spec says
make a request of one item, answered without a batch dimension.

A body sent with ``Content-Encoding: gzip`` or ``deflate`` (zlib or raw) is inflated
first, up to ``MAX_DECODED_BYTES`` (more is a ``RequestTooLarge``, 413).

Every way a body can be wrong is a ``ClientError`` (400) or ``ValidationError``
(422) that names the input and what to send instead, never an exception from numpy:
a shape is a list of at most ``MAX_DIMS`` non-negative integers describing at most
``MAX_ELEMENTS`` elements (zero dimensions aside); ``data`` is a (nested) list whose
size matches the shape (strings for BYTES, true/false for BOOL); binary tensors
(``binary_data_size``) have exactly the bytes their shape and datatype need, and
together use every byte after the JSON header, no more and no less.

The gRPC codec (``runtime.server.grpc.tensors``) decodes and encodes through the same
public functions (``shape_of``, ``bytes_from_binary``, ``apply_scheduling``,
``apply_requested_outputs``, ``check_against_specs``, ``response_tensors``,
``binary_data``), so both transports refuse the same requests with the same messages.
``run_infer`` (and ``submit_infer``, its callback form) hand a decoded request to the
engine: ``Engine.infer`` for one item, ``Engine.infer_items`` for several.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import orjson

from runtime.api.errors import (ClientError, ModelError, RequestTooLarge, UnsupportedEncoding,
                                ValidationError)
from runtime.api.model import DATATYPES, TensorSpec
from runtime.server.bounds import (ITEM_BYTES, MAX_JSON_BYTES, MAX_REQUEST_ITEMS, MemoryBudget,
                                   RequestBounds, Reservation, check_json_size, itemsize,
                                   tensor_bytes)

HEADER_LENGTH = "inference-header-content-length"
#: the most dimensions a tensor may have (numpy's own limit)
MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
#: the most elements a shape may describe, its zero dimensions counted as 1 (more than
#: any request body holds, at one byte an element: a larger span declares work, such as
#: a batch of 2**32 empty items, that no data backs)
MAX_ELEMENTS = 1 << 27
#: no bounds but the codec's own (tests of the codec alone)
UNBOUNDED = RequestBounds()
#: the most bytes a compressed request body may inflate to (the HTTP server's own
#: body limit, ``runtime.server.http1.MAX_BODY_BYTES``)
MAX_DECODED_BYTES = 64 * 1024 * 1024
_NP_TO_V2: dict[Any, str] = {np.dtype(v): k for k, v in DATATYPES.items()}
_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY


@dataclass(slots=True)
class InferRequest:
    """One decoded ``/infer`` call."""

    inputs: dict[str, np.ndarray]
    id: str | None = None
    #: engine priority (0 = most urgent) or None for the model's default
    priority: int | None = None
    timeout_ms: float | None = None
    bypass: bool = False
    #: the LoRA adapter the request names (parameter ``adapter``; None: the base model)
    adapter: str | None = None
    #: names of the outputs asked for (None = all) and which of them go back as binary
    outputs: list[str] | None = None
    binary_outputs: set[str] | frozenset[str] = frozenset()
    binary_all: bool = False
    #: k when the client sent its inputs with a leading batch dimension of k, else None
    batch_size: int | None = None
    #: the per-item inputs of a request of more than one item (``inputs`` then holds
    #: the whole ``[k, ...]`` arrays); None for one item, whose inputs are ``inputs``
    #: (a batch dimension of 1 taken off)
    items: list[dict[str, np.ndarray]] | None = None
    #: the memory its arrays hold (``runtime.server.bounds.MemoryBudget``), released
    #: by whoever answers it
    reservation: Reservation | None = None

    def release(self) -> None:
        """Give back the memory reserved for this request's arrays (idempotent)."""
        if self.reservation is not None:
            self.reservation.release()

    @property
    def batched(self) -> bool:
        """The client sent a batch dimension: the outputs carry one too."""
        return self.batch_size is not None


#: what a request's engine call answers: one item's outputs, or every item's in order
Result = dict[str, np.ndarray] | list[dict[str, np.ndarray]]


class OutputTensor(NamedTuple):
    """One output as it goes back: its name, Open Inference Protocol datatype, shape
    (led by the batch dimension when the request had one) and values."""

    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray


# -- request ------------------------------------------------------------------------
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


def apply_scheduling(params: dict, priority_levels: int, req: InferRequest) -> None:
    """Set ``req``'s priority, timeout, bypass lane, adapter and ``binary_data_output``
    from the request's parameters (plain values), checked against the model's ``priority_levels``."""
    pr = params.get("priority")
    if pr is not None:
        if not isinstance(pr, int) or isinstance(pr, bool):
            raise ClientError(f"parameter priority={pr!r} must be an integer")
        if not 0 <= pr <= priority_levels:
            raise ValidationError(
                f"priority {pr} is out of range: send 1 (most urgent) to {priority_levels}, "
                "or 0/omit it for the model's default priority")
        req.priority = pr - 1 if pr > 0 else None
    timeout = params.get("timeout")
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) \
                or not math.isfinite(timeout) or timeout < 0:
            raise ClientError(f"parameter timeout={timeout!r} must be a non-negative number "
                              "of microseconds")
        req.timeout_ms = timeout / 1000.0 if timeout > 0 else None
    for key in ("realtime", "bypass"):
        flag = params.get(key)
        if flag is not None:
            if not isinstance(flag, bool):
                raise ClientError(f"parameter {key}={flag!r} must be true or false")
            req.bypass = req.bypass or flag
    if params.get("binary_data_output") is True:
        req.binary_all = True
    adapter = params.get("adapter")
    if adapter is not None:
        if not isinstance(adapter, str):
            raise ClientError(f"parameter adapter={adapter!r} must be an adapter's name "
                              "(a string)")
        req.adapter = adapter or None


def apply_requested_outputs(outputs: Any, specs: Sequence[TensorSpec],
                            req: InferRequest) -> None:
    """Set ``req.outputs`` (and the ones asked for as binary) from the request's
    ``outputs`` list of ``{name, parameters}``; None leaves every output."""
    if outputs is None:
        return
    if not isinstance(outputs, list):
        raise ClientError("'outputs' must be a list of {name} objects")
    known = {s.name for s in specs}
    names: list[str] = []
    for o in outputs:
        name = o.get("name") if isinstance(o, dict) else None
        if not isinstance(name, str):
            raise ClientError("each entry of 'outputs' needs a 'name' string")
        if name not in known:
            raise ClientError(f"unknown output {name!r}; this model's outputs are {sorted(known)}")
        params = o.get("parameters")
        if params is not None and type(params) is not dict:
            raise ClientError(f"output {name!r}: 'parameters' must be a JSON object, got "
                              f"{_quote(params)}")
        if params is not None and params.get("binary_data") is True:
            if not isinstance(req.binary_outputs, set):
                req.binary_outputs = set()
            req.binary_outputs.add(name)
        names.append(name)
    req.outputs = names


def _shape_text(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_against_specs(model: str, specs: Sequence[TensorSpec], tensors: dict[str, np.ndarray],
                        datatypes: dict[str, str], req: InferRequest) -> None:
    """Check the decoded ``tensors`` (with the ``datatypes`` they were sent as) against
    the model's input specs, and set ``req``'s batch from a leading batch dimension."""
    complete = len(tensors) == len(specs)
    if complete:
        for spec in specs:
            if spec.name not in tensors:
                complete = False
                break
    if not complete:
        unknown = sorted(set(tensors) - {s.name for s in specs})
        if unknown:
            raise ClientError(f"model {model!r} has no input(s) {unknown}; its inputs are "
                              f"{[s.name for s in specs]}")
    #: the leading dimension of every input sent with a batch dimension
    sizes: dict[str, int] = {}
    for spec in specs:
        arr = tensors.get(spec.name)
        if arr is None:
            if spec.optional:
                continue
            raise ClientError(f"model {model!r} needs input {spec.name!r} ({spec.datatype}, "
                              f"shape {list(spec.shape)}); the request has {sorted(tensors)}")
        if datatypes[spec.name] != spec.datatype:
            raise ClientError(f"input {spec.name!r} must have datatype {spec.datatype}, "
                              f"got {datatypes[spec.name]}")
        shape = arr.shape
        want_shape = spec.shape
        if len(shape) == len(want_shape) + 1:
            sizes[spec.name] = shape[0]
            shape = shape[1:]
        if shape != want_shape and (len(shape) != len(want_shape) or any(
                want != -1 and want != got for want, got in zip(want_shape, shape))):
            raise ClientError(f"input {spec.name!r} must have shape {list(spec.shape)}, or "
                              f"{_shape_text(['k', *spec.shape])} for a batch of k items "
                              f"(-1 = any size), got {list(arr.shape)}")
    if sizes:
        _batch(specs, tensors, sizes, req)


def _batch(specs: Sequence[TensorSpec], tensors: dict[str, np.ndarray], sizes: dict[str, int],
           req: InferRequest) -> None:
    """Set the request's batch from the inputs sent with a batch dimension (``sizes``)."""
    k = next(iter(sizes.values()))
    if any(n != k for n in sizes.values()):
        raise ClientError(f"the inputs disagree on the batch size (leading dimensions "
                          f"{sizes}); send every input with the same number of items")
    if len(sizes) < len(specs):
        if k != 1:
            loose = [s.name for s in specs if s.name not in sizes]
            raise ClientError(f"input(s) {loose} have no batch dimension while "
                              f"{sorted(sizes)} hold a batch of {k}; send every input with "
                              f"the leading dimension {k}")
        for name in sizes:  # a leading 1 on some inputs only: one item, no batch
            tensors[name] = tensors[name][0]
        return
    if k == 0:
        raise ClientError("the inputs hold a batch of 0 items; send at least one")
    req.batch_size = k
    if k == 1:
        for name in sizes:
            tensors[name] = tensors[name][0]
        return
    names = list(sizes)
    req.items = [{name: tensors[name][i] for name in names} for i in range(k)]


def decoded_body(body: bytes, content_encoding: str | None,
                 limit: int = MAX_DECODED_BYTES) -> bytes:
    """``body`` without the codings ``content_encoding`` names (gzip, deflate, identity,
    applied in the order listed); at most ``limit`` bytes, else ``RequestTooLarge``."""
    if not content_encoding:
        return body
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding in ("gzip", "x-gzip"):
            body = _inflate(body, 16 + zlib.MAX_WBITS, "gzip", limit)
        elif coding == "deflate":
            zlib_header = (len(body) >= 2 and body[0] & 0x0F == 8
                           and (body[0] << 8 | body[1]) % 31 == 0)
            body = _inflate(body, zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS,
                            "deflate", limit)
        else:
            raise UnsupportedEncoding(f"Content-Encoding {coding!r} is not supported; send the "
                                      "body uncompressed, or compressed with gzip or deflate")
    return body


INFLATE_SLICE_BYTES = 1 << 20


def _inflate(data: bytes, wbits: int, coding: str, limit: int) -> bytes:
    """Inflate ``data`` (several gzip members one after the other, too), at most ``limit``
    bytes out, in slices of ``INFLATE_SLICE_BYTES``: zlib lets go of the GIL while it
    works, and the slices keep any one hold on it short, so a bomb costs the event loop
    nothing and stops at ``limit`` + 1 bytes."""
    parts: list[bytes] = []
    total = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        pending = data
        while True:
            try:
                out = inflater.decompress(pending, min(INFLATE_SLICE_BYTES, limit - total + 1))
            except zlib.error as exc:
                raise ClientError(f"the request body is not valid {coding} data ({exc}); "
                                  f"send it compressed with {coding}, or drop "
                                  "Content-Encoding") from None
            total += len(out)
            if total > limit:
                raise RequestTooLarge(f"the {coding}-compressed request body inflates to more "
                                      f"than this server accepts ({limit} bytes); send a "
                                      "smaller request")
            parts.append(out)
            pending = inflater.unconsumed_tail
            if inflater.eof or (not pending and not out):
                break
        if not inflater.eof:
            raise ClientError(f"the {coding}-compressed request body ends before its "
                              "compressed stream does; send the whole body")
        data = inflater.unused_data
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if coding != "gzip":
            raise ClientError(f"the request body has {len(data)} bytes after its {coding} "
                              "stream; send exactly one compressed stream")


def parse_infer(body: bytes, header_length: str | None, model: str,
                specs: Sequence[TensorSpec], output_specs: Sequence[TensorSpec],
                priority_levels: int, content_encoding: str | None = None,
                bounds: RequestBounds = UNBOUNDED, budget: MemoryBudget | None = None
                ) -> InferRequest:
    """Decode and check one ``/infer`` body (inflated first when ``content_encoding``
    names a compression); raises ClientError/ValidationError/RequestTooLarge, or
    InsufficientMemory when ``budget`` is full.

    Everything the body declares is checked before a value is converted: the size of
    its JSON (``MAX_JSON_BYTES``), every input's shape against the model's spec and
    ``bounds`` (items, variable lengths), then the bytes its arrays will hold, which
    are reserved in ``budget`` (``req.reservation``; the caller releases it when the
    request is answered, and it is released here if decoding fails)."""
    if content_encoding:  # a JSON-only body can never need more than the JSON cap
        body = decoded_body(body, content_encoding,
                            MAX_DECODED_BYTES if header_length is not None
                            else MAX_JSON_BYTES)
    binary: memoryview | None = None
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise ClientError(f"Inference-Header-Content-Length={header_length!r} is not an "
                              "integer") from None
        if not 0 < n <= len(body):
            raise ClientError(f"Inference-Header-Content-Length={n} does not fit a body of "
                              f"{len(body)} bytes")
        binary = memoryview(body)[n:]
        body = body[:n]
    check_json_size(len(body), "the request's JSON" if binary is None else
                    "the request's JSON header",
                    "send the tensors' values with the binary tensor extension "
                    "(binary_data_size and Inference-Header-Content-Length; tritonclient: "
                    "binary_data=True)")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ClientError(f"the request body is not valid JSON ({exc}); send "
                          '{"inputs": [{"name", "shape", "datatype", "data"}]}') from None
    if not isinstance(doc, dict):
        raise ClientError('the request body must be a JSON object with an "inputs" list')
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ClientError('the request needs a non-empty "inputs" list of '
                          '{"name", "shape", "datatype", "data"} objects')
    declared: list[_Input] = []
    seen: set[str] = set()
    offset = 0
    items = 1
    for i, t in enumerate(raw_inputs):
        d, offset = _declared(t, i, binary, offset)
        if d.name in seen:
            raise ClientError(f"input {d.name!r} appears more than once")
        seen.add(d.name)
        items = max(items, check_declared(model, specs, d.name, d.shape, bounds))
        declared.append(d)
    if binary is not None and offset != len(binary):
        raise ClientError(f"the body has {len(binary) - offset} bytes after the binary data of "
                          f"its inputs (their binary_data_size add up to {offset} of the "
                          f"{len(binary)} bytes after the JSON header); send exactly the "
                          "bytes the inputs declare")
    reservation = None
    if budget is not None:
        reservation = budget.reserve(declared_bytes(
            [(d.datatype, d.count, d.size if d.size is not None else len(body))
             for d in declared], items), f"this request to {model!r}")
    try:
        tensors: dict[str, np.ndarray] = {}
        datatypes: dict[str, str] = {}
        offset = 0
        for d in declared:
            tensors[d.name] = _values(d, binary, offset)
            datatypes[d.name] = d.datatype
            if d.size is not None:
                offset += d.size
        req_id = doc.get("id")
        req = InferRequest(inputs=tensors, id=None if req_id is None else str(req_id))
        params = doc.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ClientError("'parameters' must be a JSON object")
            apply_scheduling(params, priority_levels, req)
        apply_requested_outputs(doc.get("outputs"), output_specs, req)
        check_against_specs(model, specs, tensors, datatypes, req)
    except BaseException:
        if reservation is not None:
            reservation.release()
        raise
    req.reservation = reservation
    return req


# -- response -----------------------------------------------------------------------
def _datatype(arr: np.ndarray, spec: TensorSpec | None) -> str:
    if spec is not None:
        return spec.datatype
    dt = _NP_TO_V2.get(arr.dtype)
    if dt is None:
        raise TypeError(f"output dtype {arr.dtype} has no Open Inference Protocol datatype")
    return dt


def _json_data(arr: np.ndarray, datatype: str) -> Any:
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
                for v in arr.reshape(-1).tolist()]
    if arr.dtype == np.float16:
        arr = arr.astype(np.float32)
    return np.ascontiguousarray(arr).reshape(-1)


def binary_data(arr: np.ndarray, datatype: str) -> bytes:
    """An output's values in the binary tensor form (BYTES: a 4-byte little-endian length
    before each element)."""
    if datatype == "BYTES":
        parts = []
        for v in arr.reshape(-1).tolist():
            b = v if isinstance(v, (bytes, bytearray)) else str(v).encode()
            parts.append(len(b).to_bytes(4, "little") + b)
        return b"".join(parts)
    return np.ascontiguousarray(arr, dtype=DATATYPES[datatype]).tobytes()


def _stacked(model: str, results: list[dict[str, np.ndarray]],
             names: list[str]) -> dict[str, np.ndarray]:
    """The outputs of a request's items, each stacked along a new leading dimension."""
    out = {}
    for name in names:
        arrays = [np.asarray(r[name]) for r in results]
        first = arrays[0].shape
        for arr in arrays:
            if arr.shape != first:
                raise ModelError(f"model {model!r} gave output {name!r} different shapes for "
                                 f"the items of one request ({list(first)} and "
                                 f"{list(arr.shape)}), so they cannot be sent as one batch; "
                                 "send those items as separate requests")
        out[name] = np.stack(arrays)
    return out


def response_tensors(model: str, req: InferRequest, result: Result,
                     output_specs: Sequence[TensorSpec]) -> list[OutputTensor]:
    """The outputs ``req`` asked for (default all), in order, as they go back on any
    transport. ``result`` is the one item's outputs, or the list of every item's outputs
    of a request of several items (``req.items``), stacked here in order; one item sent
    with a batch dimension of 1 gets that dimension back."""
    specs = {s.name: s for s in output_specs}
    several = isinstance(result, list)
    names = req.outputs if req.outputs is not None else list(result[0] if several else result)
    if several:
        result = _stacked(model, result, names)
    lead = [1] if req.batched and not several else []
    tensors = []
    for name in names:
        arr = np.asarray(result[name])
        tensors.append(OutputTensor(name, _datatype(arr, specs.get(name)),
                                    lead + list(arr.shape), arr))
    return tensors


def encode_infer(model: str, version: str, req: InferRequest, result: Result,
                 output_specs: Sequence[TensorSpec]) -> tuple[bytes, dict[str, str]]:
    """The response body and extra headers (``Inference-Header-Content-Length`` if binary);
    ``result`` as ``response_tensors`` takes it."""
    outputs = []
    blobs: list[bytes] = []
    for out in response_tensors(model, req, result, output_specs):
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": out.shape}
        if req.binary_all or out.name in req.binary_outputs:
            blob = binary_data(out.array, out.datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_data(out.array, out.datatype)
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": outputs}
    if req.id is not None:
        doc["id"] = req.id
    head = orjson.dumps(doc, option=_DUMPS_OPTS)
    if not blobs:
        return head, {}
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}


# -- engine -------------------------------------------------------------------------
async def run_infer(engine: Any, model: str, req: InferRequest, trace: Any = None) -> Result:
    """Run a decoded request through ``engine`` (the ``Engine`` contract): one item
    through ``Engine.infer``, several (``req.items``) through ``Engine.infer_items``.
    The answer is what ``encode_infer`` and ``response_tensors`` take. ``trace``: the
    request's ``RequestTrace`` when it is traced (passed on only then)."""
    if req.adapter is not None:
        if req.items is None:
            return await engine.infer(model, req.inputs, priority=req.priority,
                                      timeout_ms=req.timeout_ms, bypass=req.bypass, trace=trace,
                                      adapter=req.adapter)
        return await engine.infer_items(model, req.items, priority=req.priority,
                                        timeout_ms=req.timeout_ms, bypass=req.bypass,
                                        trace=trace, adapter=req.adapter)
    if trace is not None:
        if req.items is None:
            return await engine.infer(model, req.inputs, priority=req.priority,
                                      timeout_ms=req.timeout_ms, bypass=req.bypass, trace=trace)
        return await engine.infer_items(model, req.items, priority=req.priority,
                                        timeout_ms=req.timeout_ms, bypass=req.bypass,
                                        trace=trace)
    if req.items is None:
        return await engine.infer(model, req.inputs, priority=req.priority,
                                  timeout_ms=req.timeout_ms, bypass=req.bypass)
    return await engine.infer_items(model, req.items, priority=req.priority,
                                    timeout_ms=req.timeout_ms, bypass=req.bypass)


def submit_infer(engine: Any, model: str, req: InferRequest,
                 on_done: Callable[[Result | None, BaseException | None], None],
                 trace: Any = None) -> None:
    """``run_infer`` in the engine's callback form (``Engine.submit`` /
    ``Engine.submit_items``): admission errors are raised here, then exactly one
    ``on_done(result, None)`` or ``on_done(None, error)``."""
    if req.adapter is not None:
        if req.items is None:
            engine.submit(model, req.inputs, req.priority, req.timeout_ms, req.bypass, on_done,
                          trace, adapter=req.adapter)
        else:
            engine.submit_items(model, req.items, req.priority, req.timeout_ms, req.bypass,
                                on_done, trace, adapter=req.adapter)
        return
    if trace is not None:
        if req.items is None:
            engine.submit(model, req.inputs, req.priority, req.timeout_ms, req.bypass, on_done,
                          trace)
        else:
            engine.submit_items(model, req.items, req.priority, req.timeout_ms, req.bypass,
                                on_done, trace)
        return
    if req.items is None:
        engine.submit(model, req.inputs, req.priority, req.timeout_ms, req.bypass, on_done)
    else:
        engine.submit_items(model, req.items, req.priority, req.timeout_ms, req.bypass,
                            on_done)
