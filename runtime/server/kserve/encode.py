"""The response side: the model's output arrays back into a v2 response body, each
output's values as JSON ``data`` or, when the request asks for it, as a binary tensor
after the JSON header. ``response_tensors`` (what goes back, in order) and
``binary_data`` serve the gRPC codec too."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import orjson

from runtime.api.errors import ModelError
from runtime.api.model import DATATYPES, TensorSpec
from runtime.server.kserve.request import InferRequest, Result

_NP_TO_V2: dict[Any, str] = {np.dtype(v): k for k, v in DATATYPES.items()}
_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY


class OutputTensor(NamedTuple):
    """One output as it goes back: its name, Open Inference Protocol datatype, shape
    (led by the batch dimension when the request had one) and values."""

    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray


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
