"""``pt2:PATH``: a program saved with ``torch.export.save`` (see ``graph_model`` for batching).

Inputs are the program's user inputs, named after the exported ``forward``'s
parameters; their dtypes and axes come from the graph (an axis exported with a
``torch.export.Dim`` is a symbol, so it is dynamic). Outputs are named ``OUTPUT0``,
``OUTPUT1``... in order, or after their keys when ``forward`` returns a dict. The
program runs with ``ExportedProgram.module()`` on ``--device`` under
``torch.inference_mode()``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import zipfile
from typing import Any, Callable, Sequence

import numpy as np
import torch

from runtime.api.errors import ConfigError
from runtime.models import inference
from runtime.models.files.graph_model import GraphModel, GraphTensor, Signature, to_numpy
from runtime.models.files.spec import FileSpec

log = logging.getLogger(__name__)

#: torch dtypes -> KServe datatypes
TYPES = {torch.float32: "FP32", torch.float64: "FP64", torch.float16: "FP16",
         torch.int64: "INT64", torch.int32: "INT32", torch.int16: "INT16", torch.int8: "INT8",
         torch.uint8: "UINT8", torch.bool: "BOOL"}


def load_program(spec: FileSpec) -> Any:
    where = f"pt2:{spec.path}"
    if not spec.path.is_file():
        raise ConfigError(f"{where}: not a file; give the file torch.export.save wrote")
    if not zipfile.is_zipfile(spec.path):
        raise ConfigError(f"{where}: not a torch.export archive (a .pt2 file is a zip archive); "
                          "save the program with torch.export.save")
    quiet = logging.getLogger("torch.export")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a failed load logs its traceback before raising
    try:
        return torch.export.load(str(spec.path))
    except Exception as exc:  # noqa: BLE001 - zip, pickle and version errors alike
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where}: torch {torch.__version__} cannot load it as an "
                          f"ExportedProgram ({first}); save it with torch.export.save") from None
    finally:
        quiet.setLevel(level)


def _tensor(name: str, value: Any, where: str) -> GraphTensor:
    datatype = TYPES.get(getattr(value, "dtype", None))
    if datatype is None:
        raise ConfigError(f"{where}: {name!r} is not a tensor of a served dtype "
                          f"({getattr(value, 'dtype', type(value).__name__)})")
    axes = tuple(int(d) if not isinstance(d, torch.SymInt) else str(d) for d in value.shape)
    return GraphTensor(name, datatype, axes)


def read_signature(program: Any, where: str) -> Signature:
    nodes = {n.name: n for n in program.graph.nodes}
    user = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    # the graph's placeholders are renamed (lower case); forward's own parameter names are not
    names = list(inspect.signature(program.module().forward).parameters)
    if len(names) != len(user):
        names = user
    inputs = tuple(_tensor(name, nodes[node].meta.get("val"), where) for name, node in zip(names, user))
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    produced = set(program.graph_signature.user_outputs)
    values = [a for a in output_node.args[0] if getattr(a, "name", None) in produced]
    keys = _output_keys(program, len(values))
    outputs = tuple(_tensor(k, a.meta.get("val"), where) for k, a in zip(keys, values))
    return Signature(inputs, outputs)


def _output_keys(program: Any, n: int) -> Sequence[str]:
    spec = getattr(program.call_spec, "out_spec", None)
    context = getattr(spec, "context", None)
    if spec is not None and getattr(spec, "type", None) is dict and context and len(context) == n:
        return [str(k) for k in context]
    return [f"OUTPUT{i}" for i in range(n)]


def views_to_reshapes(module: Any) -> int:
    """Turn the graph's ``view`` calls into ``reshape``; returns how many.

    Export traces ``x.contiguous().view(...)`` and ``x.reshape(...)`` into a bare
    ``view`` when ``x`` was contiguous on the export device, so the graph holds the
    strides of that device's kernels. Another device's kernels may give other strides
    (CUDA attention's output, transposed, where the CPU's is contiguous), and the bare
    ``view`` then fails. ``reshape`` is that same view wherever the strides allow one,
    and a copy elsewhere; an exported graph is functional, so nothing writes through the
    view and the two give equal results."""
    view, reshape = torch.ops.aten.view.default, torch.ops.aten.reshape.default
    changed = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        hits = [n for n in graph.nodes if n.op == "call_function" and n.target is view]
        for node in hits:
            node.target = reshape
        if hits:
            recompile = getattr(sub, "recompile", None)  # an interpreted graph has none
            if callable(recompile):
                recompile()
            changed += len(hits)
    return changed


class ExportedModel(GraphModel):
    platform = "torch_export"

    def __init__(self, spec: FileSpec) -> None:
        program = load_program(spec)
        super().__init__(spec, read_signature(program, f"pt2:{spec.path}"))
        self.module: Any = None

    def setup(self, device: Any) -> None:
        self.device = torch.device(device)
        program = load_program(self.spec)
        if self.device.type != "cpu":
            # the graph holds the device it was exported on (tensors it makes, constants):
            # moving the module's weights alone leaves those on the CPU
            try:
                from torch.export.passes import move_to_device_pass
            except ImportError:  # torch before 2.6: the weights move, the graph does not
                log.warning("this torch has no torch.export.passes.move_to_device_pass; "
                            "pt2:%s may keep tensors it makes on its export device", self.spec.path)
            else:
                program = move_to_device_pass(program, self.device)
        self.module = program.module().to(self.device)
        reshapes = views_to_reshapes(self.module)
        log.debug("pt2:%s: %d views run as reshapes", self.spec.path, reshapes)
        self._order = [t.name for t in self.signature.inputs]

    def run(self, feeds: dict[str, np.ndarray], forward: Any = None,
            outside_inference: bool = False) -> list[torch.Tensor]:
        with contextlib.ExitStack() as modes:
            if outside_inference:  # ordinary tensors, made and used outside inference mode
                modes.enter_context(torch.inference_mode(False))
                modes.enter_context(torch.no_grad())
            args = [torch.from_numpy(feeds[name]).to(self.device, non_blocking=True)
                    for name in self._order]
            if not outside_inference:
                modes.enter_context(inference())
            out = (self.module if forward is None else forward)(*args)
        if isinstance(out, dict):
            return list(out.values())
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def predict_compiled_with(self, compile: Callable[[Any], Any],
                              outside_inference: bool = False) -> Callable:
        """``predict`` with the program's module through ``compile`` (``torch.compile``,
        the ``compile`` setting): the module is what there is to compile, and a compiled
        frame that takes the batch's numpy arrays fails its own guards (torch 2.13)."""
        forward = compile(self.module)

        def predict(batch: tuple[dict[str, np.ndarray], list[int]]) -> Any:
            feeds, lengths = batch
            return [to_numpy(o) for o in self.run(feeds, forward, outside_inference)], lengths

        return predict

    def backend_options(self) -> dict[str, Any]:
        return {"torch": torch.__version__}

