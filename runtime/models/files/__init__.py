"""Models served from the files users already have, without writing a ``ModelAPI``.

``batchscope serve --model KIND:PATH[,key=value...]`` (or ``NAME=KIND:PATH...``):

* ``hf:DIR`` — a Hugging Face directory: ``task=embeddings`` or ``classification``
  (``hf_text``), ``task=generation`` through continuous batching (``hf_causal``);
* ``onnx:FILE`` — an ONNX graph on ONNX Runtime (``onnx_model``);
* ``pt2:FILE`` — a ``torch.export`` program (``exported``).

The options each kind takes are in ``spec.OPTIONS``. Whatever is wrong with the file is
a ``ConfigError`` naming what is missing and what to do.
"""

from __future__ import annotations

from typing import Any

from runtime.models.files.spec import KINDS, FileSpec


def is_file_spec(target: str) -> bool:
    return target.partition(":")[0] in KINDS


def load_file_model(target: str) -> Any:
    spec = FileSpec.parse(target)
    if spec.kind == "onnx":
        from runtime.models.files.onnx_model import OnnxModel

        return OnnxModel(spec)
    if spec.kind == "pt2":
        from runtime.models.files.exported import ExportedModel

        return ExportedModel(spec)
    from runtime.models.files.hf_text import HFTextModel, infer_task, read_config

    task = spec.option("task") or infer_task(read_config(spec.path))
    if task == "generation":
        from runtime.models.files.hf_causal import HFCausalLM

        return HFCausalLM(spec)
    return HFTextModel(spec, str(task))
