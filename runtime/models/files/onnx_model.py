"""``onnx:PATH``: an ONNX graph run by ONNX Runtime (see ``graph_model`` for batching).

The execution provider follows ``--device``: the CPU provider on ``cpu``; on ``cuda:N``
the CUDA provider on device N, or TensorRT first with ``provider=tensorrt``; the CPU
provider stays behind them for the nodes they do not take. ``provider=cuda`` on a
build of ONNX Runtime without CUDA (the ``onnxruntime`` wheel; ``onnxruntime-gpu`` has
it) refuses to start rather than silently running on the CPU. Intra-op threads are
the device process' torch threads (``--torch-threads``), inter-op one: the runtime
already runs one batch at a time per model.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from runtime.api.errors import ConfigError
from runtime.models.files.graph_model import GraphModel, GraphTensor, Signature
from runtime.models.files.spec import FileSpec

INSTALL_HINT = "pip install 'batchscope[onnx]' (onnxruntime; onnxruntime-gpu for CUDA)"
#: ONNX Runtime's type strings -> KServe datatypes
TYPES = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(float16)": "FP16",
         "tensor(int64)": "INT64", "tensor(int32)": "INT32", "tensor(int16)": "INT16",
         "tensor(int8)": "INT8", "tensor(uint8)": "UINT8", "tensor(bool)": "BOOL",
         "tensor(string)": "BYTES"}


def ort_module() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError(f"onnx: models need the package onnxruntime: {INSTALL_HINT}") from None
    onnxruntime.set_default_logger_severity(3)
    return onnxruntime


def _tensor(arg: Any, where: str) -> GraphTensor:
    datatype = TYPES.get(arg.type)
    if datatype is None:
        raise ConfigError(f"{where}: tensor {arg.name!r} has type {arg.type}, which the server "
                          f"does not serve; use one of {', '.join(TYPES)}")
    axes = tuple(a if isinstance(a, int) else (a or f"{arg.name}_axis{i}")
                 for i, a in enumerate(arg.shape or ()))
    return GraphTensor(arg.name, datatype, axes)


def read_signature(session: Any, where: str) -> Signature:
    return Signature(tuple(_tensor(a, where) for a in session.get_inputs()),
                     tuple(_tensor(a, where) for a in session.get_outputs()))


def providers_for(device: Any, choice: str, available: Sequence[str], where: str) -> list[Any]:
    """The provider list for ``device`` (a torch.device) and the ``provider`` option."""
    if device.type == "cpu" or choice == "cpu":
        if choice not in ("auto", "cpu"):
            raise ConfigError(f"{where}: provider={choice} needs --device cuda")
        return ["CPUExecutionProvider"]
    index = {"device_id": device.index or 0}
    wanted = ["TensorrtExecutionProvider", "CUDAExecutionProvider"] if choice == "tensorrt" \
        else ["CUDAExecutionProvider"]
    missing = [p for p in wanted if p not in available]
    if missing:
        raise ConfigError(f"{where}: ONNX Runtime here has no {', '.join(missing)} (it has "
                          f"{', '.join(available)}); install onnxruntime-gpu, or serve with "
                          "--device cpu")
    return [(p, dict(index)) for p in wanted] + ["CPUExecutionProvider"]


class OnnxModel(GraphModel):
    platform = "onnxruntime_onnx"

    def __init__(self, spec: FileSpec) -> None:
        ort = ort_module()
        where = f"onnx:{spec.path}"
        if not spec.path.is_file():
            raise ConfigError(f"{where}: not a file; give the .onnx file torch.onnx.export wrote")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:  # read the signature only; the device side builds the session it runs
            probe = ort.InferenceSession(str(spec.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise ConfigError(f"{where}: ONNX Runtime cannot load it: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc}") from None
        signature = read_signature(probe, where)
        del probe
        super().__init__(spec, signature)
        self.session: Any = None
        self.threads = 0
        self.providers: list[Any] = []

    def setup(self, device: Any) -> None:
        import torch

        ort = ort_module()
        self.device = torch.device(device)
        where = f"onnx:{self.spec.path}"
        self.providers = providers_for(self.device, str(self.spec.option("provider", "auto")),
                                       ort.get_available_providers(), where)
        options = ort.SessionOptions()
        self.threads = torch.get_num_threads()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(self.spec.path), options, providers=self.providers)
        self._names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self._names, feeds)

    def backend_options(self) -> dict[str, Any]:
        names = [p if isinstance(p, str) else p[0] for p in self.providers]
        return {"providers": names or None, "intra_op_threads": self.threads or None}
