"""A model whose inputs, outputs and dynamic axes come from a saved graph (ONNX, torch.export).

A backend (``runtime.models.files.onnx_model``, ``runtime.models.files.exported``)
reads the graph's ``Signature``: each input and output with its datatype and its axes,
an axis being a fixed size or a symbol (``"batch"``, ``"s0"``...). ``GraphModel`` serves
any such graph with the runtime's batching:

* axis 0 of every input must be dynamic: it is the batch axis (a graph exported for a
  fixed batch size cannot be batched, so the server refuses it at start);
* the other dynamic axes are variable lengths: the first of them (the *length axis*)
  gives a request's length for bucketing, and ``collate`` pads every dynamic axis with
  zeros to the longest item (or to the bucket edge on the length axis);
* padding masks are made by the server, not sent by clients: an input named
  ``attention_mask`` gets 1 on real positions and 0 on padding, one whose name holds
  ``pad`` and ``mask`` (``pad_mask``, ``key_padding_mask``) the opposite, and
  ``token_type_ids`` zeros — each only when its axes are (batch, length);
* an output axis with the length axis' symbol is cut back to each request's own length.

Clients send the other inputs without the batch axis (or with a leading 1), as for any
model; their datatypes are converted from whatever integer/float kind was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from runtime.api.errors import ClientError, ConfigError, ValidationError
from runtime.api.model import DATATYPES, ModelAPI, TensorSpec
from runtime.models import take_input
from runtime.models.files.spec import FileSpec

Axis = int | str
ATTENTION_MASK = "attention_mask"
TOKEN_TYPES = "token_type_ids"


@dataclass(frozen=True, slots=True)
class GraphTensor:
    name: str
    datatype: str  # a KServe datatype: FP32, INT64, BOOL...
    axes: tuple[Axis, ...]


@dataclass(frozen=True, slots=True)
class Signature:
    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]


def made_by_server(t: GraphTensor, length_axis: str | None) -> str | None:
    """'attention'/'padding'/'zeros' for an input the server fills itself, else None."""
    if length_axis is None or len(t.axes) != 2 or t.axes[1] != length_axis:
        return None
    lowered = t.name.lower()
    if lowered == ATTENTION_MASK:
        return "attention"
    if "pad" in lowered and "mask" in lowered:
        return "padding"
    if lowered == TOKEN_TYPES:
        return "zeros"
    return None


class GraphModel(ModelAPI):
    """Serve a graph through a backend's ``run(feeds) -> outputs`` (see the module docstring)."""

    platform = "graph"

    def __init__(self, spec: FileSpec, signature: Signature) -> None:
        self.spec = spec
        self.signature = signature
        where = f"{spec.kind}:{spec.path}"
        for t in signature.inputs:
            if not t.axes or isinstance(t.axes[0], int):
                raise ConfigError(
                    f"{where}: input {t.name!r} has a fixed first axis {list(t.axes)}; export the "
                    "graph with a dynamic batch axis (torch.onnx.export dynamic_shapes / "
                    "dynamic_axes, torch.export Dim) so requests can be batched")
            if t.datatype not in DATATYPES or t.datatype == "BYTES":
                raise ConfigError(f"{where}: input {t.name!r} has datatype {t.datatype}, which "
                                  "the server cannot batch")
        self.length_axis = next((a for t in signature.inputs for a in t.axes[1:]
                                 if isinstance(a, str)), None)
        self.filled = {t.name: kind for t in signature.inputs
                       if (kind := made_by_server(t, self.length_axis))}
        self.sent = tuple(t for t in signature.inputs if t.name not in self.filled)
        if not self.sent:
            raise ConfigError(f"{where}: every input would be made by the server; nothing is left "
                              "for a request to send")
        self.name = spec.default_name()
        self.inputs = tuple(TensorSpec(t.name, t.datatype, _item_shape(t)) for t in self.sent)
        self.outputs = tuple(TensorSpec(t.name, t.datatype, _item_shape(t))
                             for t in signature.outputs)
        self.variable_length = self.length_axis is not None
        self.max_length = spec.option("max_length") if self.variable_length else None
        self.embedding_output = None
        self._np_types = {t.name: np.dtype(DATATYPES[t.datatype]) for t in signature.inputs}

    # -- the backend's part -------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray]) -> Sequence[Any]:
        raise NotImplementedError

    # -- requests -----------------------------------------------------------------------
    def decode(self, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        item = []
        for t in self.sent:
            want = _item_shape(t)
            arr = take_input(inputs, t.name, len(want), f"{t.datatype} {list(want)}")
            arr = _converted(t, arr, self._np_types[t.name])
            for axis, (size, got) in enumerate(zip(want, arr.shape)):
                if size != -1 and size != got:
                    raise ClientError(f"input {t.name!r} must have shape {list(want)}; got "
                                      f"{list(arr.shape)}")
                if size == -1 and got == 0:
                    raise ValidationError(f"input {t.name!r} is empty along axis {axis}")
            item.append(arr)
        n = self._length_of(item)
        if self.max_length is not None and n > self.max_length:
            raise ValidationError(f"the request is {n} long; model {self.name!r} takes at most "
                                  f"{self.max_length} (max_length)")
        return tuple(item)

    def _length_of(self, item: Sequence[np.ndarray]) -> int:
        if self.length_axis is None:
            return 1
        for t, arr in zip(self.sent, item):
            for axis, a in enumerate(t.axes[1:]):
                if a == self.length_axis:
                    return int(arr.shape[axis])
        return 1

    def length(self, item: tuple[np.ndarray, ...]) -> int:
        return self._length_of(item)

    def collate(self, items: list[tuple[np.ndarray, ...]], pad_to: int | None
                ) -> tuple[dict[str, np.ndarray], list[int]]:
        lengths = [self._length_of(it) for it in items]
        width = max(max(lengths), pad_to or 0)
        feeds: dict[str, np.ndarray] = {}
        for k, t in enumerate(self.sent):
            rows = [it[k] for it in items]
            shape = [max(r.shape[a] for r in rows) for a in range(rows[0].ndim)]
            for a, sym in enumerate(t.axes[1:]):
                if sym == self.length_axis:
                    shape[a] = width
            if all(list(r.shape) == shape for r in rows):
                feeds[t.name] = np.stack(rows)
                continue
            out = np.zeros((len(rows), *shape), dtype=self._np_types[t.name])
            for i, r in enumerate(rows):
                out[(i, *(slice(0, s) for s in r.shape))] = r
            feeds[t.name] = out
        if self.filled:
            real = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
            for name, kind in self.filled.items():
                value = real if kind == "attention" else ~real if kind == "padding" \
                    else np.zeros_like(real)
                feeds[name] = value.astype(self._np_types[name])
        return feeds, lengths

    def predict(self, batch: tuple[dict[str, np.ndarray], list[int]]) -> tuple[list[np.ndarray], list[int]]:
        feeds, lengths = batch
        return [to_numpy(o) for o in self.run(feeds)], lengths

    def split(self, output: tuple[list[np.ndarray], list[int]], n: int) -> list[dict[str, np.ndarray]]:
        arrays, lengths = output
        results: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
        for t, arr in zip(self.signature.outputs, arrays):
            cut = [a for a, sym in enumerate(t.axes[1:]) if sym == self.length_axis]
            for i in range(n):
                row = arr[i]
                if cut:
                    row = row[tuple(slice(0, lengths[i]) if a in cut else slice(None)
                                    for a in range(row.ndim))]
                results[i][t.name] = row
        return results

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        meta["platform"] = self.platform
        meta["source"] = {**self.spec.describe(), **self.backend_options(),
                          "length_axis": self.length_axis,
                          "inputs_made_by_server": dict(self.filled)}
        return meta

    def backend_options(self) -> dict[str, Any]:
        return {}


def _item_shape(t: GraphTensor) -> tuple[int, ...]:
    return tuple(a if isinstance(a, int) else -1 for a in t.axes[1:])


def _converted(t: GraphTensor, arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if arr.dtype == dtype:
        return arr
    if arr.dtype.kind not in "biuf" or (dtype.kind in "iub" and arr.dtype.kind == "f"):
        raise ClientError(f"input {t.name!r} has datatype {arr.dtype}; the model takes "
                          f"{t.datatype}")
    return arr.astype(dtype)


def to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    method: Callable[[], np.ndarray] | None = getattr(value, "numpy", None)
    if method is not None:
        return value.detach().cpu().numpy()
    return np.asarray(value)
