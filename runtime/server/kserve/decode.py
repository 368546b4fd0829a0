"""The request side: ``parse_infer`` turns an ``/infer`` body (JSON, or JSON followed by
raw tensor bytes when the client uses the binary tensor extension) into one request's
named numpy arrays plus its scheduling parameters, checking every tensor against the
model's ``TensorSpec``s.

Every way a body can be wrong is a ``ClientError`` (400) or ``ValidationError``
(422) that names the input and what to send instead, never an exception from numpy:
a shape is a list of at most ``MAX_DIMS`` non-negative integers describing at most
``MAX_ELEMENTS`` elements (zero dimensions aside); ``data`` is a (nested) list whose
size matches the shape (strings for BYTES, true/false for BOOL); binary tensors
(``binary_data_size``) have exactly the bytes their shape and datatype need, and
together use every byte after the JSON header, no more and no less.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import orjson

from runtime.api.errors import ClientError
from runtime.api.model import TensorSpec
from runtime.server.bounds import MAX_JSON_BYTES, MemoryBudget, RequestBounds, check_json_size
from runtime.server.kserve.compression import MAX_DECODED_BYTES, decoded_body
from runtime.server.kserve.inputs import _declared, _Input, _values, check_declared, declared_bytes
from runtime.server.kserve.request import (InferRequest, apply_requested_outputs,
                                           apply_scheduling, check_against_specs)

HEADER_LENGTH = "inference-header-content-length"
#: no bounds but the codec's own (tests of the codec alone)
UNBOUNDED = RequestBounds()


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
