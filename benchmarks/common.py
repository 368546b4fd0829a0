"""Shared pieces of the benchmarks: request inputs, a minimal KServe v2 JSON codec, tables.

The inputs are generated from a seed so that every tool (offline loop, baseline server,
batching server) is driven with the same data.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # allow `python benchmarks/<script>.py` as well as `-m`
    sys.path.insert(0, str(ROOT))

from runtime.api.errors import ClientError  # noqa: E402
from runtime.api.model import DATATYPES, ModelAPI  # noqa: E402

SENTENCE_WORDS = ("batch", "queue", "latency", "token", "model", "device", "request", "graph",
                  "memory", "throughput", "deadline", "priority", "bucket", "padding", "kernel")


def set_torch_threads(threads: int = 1) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # only settable before the first parallel work
        pass


def make_inputs(model: str, count: int, *, seed: int = 0, min_length: int = 8,
                max_length: int = 128) -> list[dict[str, np.ndarray]]:
    """``count`` requests for a bundled model; variable-length models draw lengths uniformly."""
    rng = np.random.default_rng(seed)
    if model == "mlp":
        xs = rng.standard_normal((count, 256)).astype(np.float32)
        return [{"INPUT0": x} for x in xs]
    if model == "encoder":
        lengths = rng.integers(min_length, max_length + 1, count)
        return [{"INPUT_IDS": rng.integers(1, 30522, n).astype(np.int64)} for n in lengths]
    if model == "minilm":
        lengths = rng.integers(max(1, min_length // 2), max(2, max_length // 2) + 1, count)
        return [{"TEXT": np.array([" ".join(rng.choice(SENTENCE_WORDS, n)).encode()], dtype=object)}
                for n in lengths]
    raise ValueError(f"no input generator for model {model!r}; use mlp, encoder or minilm")


def decode_infer_request(doc: Any, model: ModelAPI) -> dict[str, np.ndarray]:
    """KServe v2 JSON ``inputs`` -> named numpy arrays (datatype and element count checked)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise ClientError('the body must be a JSON object with an "inputs" list')
    out: dict[str, np.ndarray] = {}
    for tensor in doc["inputs"]:
        try:
            name, datatype, shape, data = (tensor["name"], tensor["datatype"],
                                           [int(d) for d in tensor["shape"]], tensor["data"])
        except (KeyError, TypeError, ValueError):
            raise ClientError("each input needs name, datatype, shape and data") from None
        if datatype not in DATATYPES:
            raise ClientError(f"input {name!r}: unknown datatype {datatype!r}")
        if datatype == "BYTES":
            arr = np.array([d.encode() if isinstance(d, str) else d for d in np.ravel(data)], dtype=object)
        else:
            arr = np.asarray(data, dtype=DATATYPES[datatype])
        if arr.size != int(np.prod(shape)):
            raise ClientError(f"input {name!r}: shape {shape} needs {int(np.prod(shape))} values, "
                              f"got {arr.size}")
        out[name] = arr.reshape(shape)
    return out


def encode_infer_response(model: ModelAPI, result: dict[str, np.ndarray], request_id: Any) -> dict:
    specs = {s.name: s for s in model.outputs}
    outputs = []
    for name, arr in result.items():
        arr = np.asarray(arr)
        outputs.append({"name": name, "datatype": specs[name].datatype if name in specs else "FP32",
                        "shape": [1, *arr.shape], "data": arr.ravel().tolist()})
    doc = {"model_name": model.name, "model_version": "1", "outputs": outputs}
    if request_id is not None:
        doc["id"] = request_id
    return doc


def format_table(rows: Sequence[dict[str, Any]], columns: Iterable[str]) -> str:
    columns = list(columns)
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run a block with ``threads`` intra-op threads, restoring the previous count after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
