"""The API a user implements to serve their own model.

A request flows through small hooks, each with one job::

    decode(inputs)        one request's named numpy arrays -> one item (tensors)
    length(item)          how long the item is, for length bucketing (default 1)
    collate(items, pad)   list of items -> one batch (padding to ``pad`` where needed)
    predict(batch)        the forward pass, under torch.inference_mode()
    split(output, n)      the batch output -> n per-request dicts of numpy arrays

``setup(device)`` runs once before the first request. Errors raised from
``decode`` as ``runtime.api.errors.ClientError``/``ValidationError`` reach the caller
as 400/422 with their message; anything raised from ``predict`` fails only the
batch it ran in.

An embedding model also names the output that holds its vector
(``embedding_output``) and implements ``embedding_inputs(value)``: one text or one
list of token ids -> the inputs ``decode`` takes, and how many tokens they hold.
``/v1/embeddings`` then serves it, each input a request of its own, batched with
every other request of the model.

A model that takes LoRA adapters declares the linear layers they may target
(``adapter_targets``: module name -> ``(in_features, out_features)``, known without its
weights, so the serving process checks an adapter's files before any device work) and
makes an ``adapter_bank`` (``runtime.adapters.lora.AdapterBank``) in ``setup``; its
``predict`` runs each row with the adapter the bank holds for it
(``docs/adapters.md``).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

#: Open Inference Protocol datatypes and the numpy dtypes they map to.
DATATYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
    "BYTES": np.object_,
}


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output; ``-1`` in ``shape`` marks a variable dimension.

    Shapes are per request (no batch dimension): the client may send them with or
    without a leading batch dimension of 1.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    #: a request may leave it out (the model takes one of several inputs, e.g. a text or
    #: its token ids); ``decode`` says what is missing when nothing usable was sent
    optional: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}
        if self.optional:
            out["optional"] = True
        return out


def _missing(cls_name: str, hook: str, example: str) -> NotImplementedError:
    return NotImplementedError(
        f"{cls_name} must implement `{hook}`. For example:\n\n"
        + textwrap.indent(textwrap.dedent(example).strip("\n"), "    ") + "\n")


class ModelAPI:
    """Base class for a servable model. Subclass it and fill in the hooks."""

    #: the name clients use in ``/v2/models/{name}/infer``
    name: ClassVar[str] = ""
    inputs: ClassVar[Sequence[TensorSpec]] = ()
    outputs: ClassVar[Sequence[TensorSpec]] = ()
    #: True when requests differ in length and length bucketing applies
    variable_length: ClassVar[bool] = False
    #: the most a single request may hold along its variable dimension
    max_length: ClassVar[int | None] = None
    #: "request" models answer one call with one result; "generate" models stream tokens
    kind: ClassVar[str] = "request"
    #: the output holding one embedding vector (shape ``(dim,)``); set it to serve the model
    #: at ``/v1/embeddings`` (with ``embedding_inputs``); None: not an embedding model
    embedding_output: ClassVar[str | None] = None
    #: the linear layers LoRA adapters may target: module name -> (in_features,
    #: out_features); empty: the model takes no adapters
    adapter_targets: ClassVar[Mapping[str, tuple[int, int]]] = {}
    #: the highest LoRA rank an adapter of this model may have
    max_adapter_rank: ClassVar[int] = 64

    device: Any = None
    #: the device-resident adapters (``runtime.adapters.lora.AdapterBank``), made in
    #: ``setup`` by a model with ``adapter_targets``
    adapter_bank: Any = None

    def setup(self, device: Any) -> None:
        """Load weights and move them to ``device`` (a ``torch.device``)."""
        self.device = device

    def decode(self, inputs: dict[str, np.ndarray]) -> Any:
        raise _missing(type(self).__name__, "decode", '''
            def decode(self, inputs):
                x = inputs["INPUT0"]                     # numpy array, no batch dim
                if x.shape != (256,):
                    raise ValidationError(f"INPUT0 must have shape [256], got {list(x.shape)}")
                return torch.from_numpy(x)
        ''')

    def length(self, item: Any) -> int:
        """The item's length along its variable dimension (used for bucketing)."""
        return 1

    def collate(self, items: list[Any], pad_to: int | None) -> Any:
        raise _missing(type(self).__name__, "collate", '''
            def collate(self, items, pad_to):
                return torch.stack(items).to(self.device)  # pad to `pad_to` if lengths vary
        ''')

    def predict(self, batch: Any) -> Any:
        raise _missing(type(self).__name__, "predict", '''
            def predict(self, batch):
                return self.net(batch)
        ''')

    def split(self, output: Any, n: int) -> list[dict[str, np.ndarray]]:
        raise _missing(type(self).__name__, "split", '''
            def split(self, output, n):
                out = output.cpu().numpy()
                return [{"OUTPUT0": out[i]} for i in range(n)]
        ''')

    def embedding_inputs(self, value: str | list[int]) -> tuple[dict[str, np.ndarray], int]:
        """One ``/v1/embeddings`` input (a text, or a list of token ids) as the inputs
        ``decode`` takes, and its number of tokens (counted in ``usage``). Raise
        ``ClientError`` for a value the model cannot embed."""
        raise _missing(type(self).__name__, "embedding_inputs", '''
            def embedding_inputs(self, value):
                ids = self.tokenizer.encode(value) if isinstance(value, str) else value
                return {"INPUT_IDS": np.asarray(ids, dtype=np.int64)}, len(ids)
        ''')

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        """Rough activation memory of a batch, for a CPU memory budget. None = unknown."""
        return None

    # -- metadata ---------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": ["1"],
            "platform": "pytorch",
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
        }


def check_model(model: ModelAPI) -> None:
    """Fail early, with the code to write, when a user's model is incomplete."""
    cls = type(model)
    if not isinstance(model, ModelAPI):
        raise TypeError(f"{cls.__name__} must subclass runtime.api.model.ModelAPI:\n\n"
                        "    from runtime.api.model import ModelAPI, TensorSpec\n"
                        f"    class {cls.__name__}(ModelAPI):\n        name = 'my-model'\n        ...")
    if not model.name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name = \"my-model\"`: "
                        "it is the name clients use in /v2/models/{{name}}/infer")
    if not model.inputs:
        raise TypeError(f"{cls.__name__} needs `inputs = [TensorSpec('INPUT0', 'FP32', (256,))]`")
    for spec in list(model.inputs) + list(model.outputs):
        if spec.datatype not in DATATYPES:
            raise TypeError(f"{cls.__name__}: tensor {spec.name!r} has datatype {spec.datatype!r}; "
                            f"use one of {sorted(DATATYPES)}")
    if model.kind == "request":
        for hook in ("decode", "collate", "predict", "split"):
            if getattr(cls, hook) is getattr(ModelAPI, hook):
                getattr(ModelAPI, hook)(model, *([None] * (2 if hook in ("collate", "split") else 1)))
    if model.embedding_output is not None:
        names = [s.name for s in model.outputs]
        if model.embedding_output not in names:
            raise TypeError(f"{cls.__name__}.embedding_output={model.embedding_output!r} names "
                            f"no output; its outputs are {names}")
        if cls.embedding_inputs is ModelAPI.embedding_inputs:
            ModelAPI.embedding_inputs(model, "")
