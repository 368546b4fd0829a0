"""What Triton's clients ask about models, built from the request engine alone.

Triton-aware tools learn a model's batching limits from its configuration, read
``perf_analyzer``-style numbers from the statistics extension and list models from
the repository index. The functions here answer those questions as plain JSON-ready
dicts in Triton's own field names, from an engine that follows the
``runtime.engine.engine.Engine`` contract; they know nothing of the transport, so
the HTTP routes (``runtime.server.routes``) send them as they are and a gRPC server
can fill Triton's protobuf messages from them (``google.protobuf.json_format``).

* ``model_metadata``: KServe v2 model metadata with the batch dimension: every
  request model batches, so each input and output shape gets a leading ``-1``
  (the model's ``TensorSpec`` shapes are per item).
* ``model_config``: ``ModelConfig`` (``model_config.proto``): ``max_batch_size``
  and the ``dims`` of each tensor without the batch dimension, and
  ``dynamic_batching`` from the model's live ``BatchingConfig``
  (``preferred_batch_size``, ``max_queue_delay_microseconds``, priority levels in
  Triton's 1-based numbering, the queue's size and default timeout).
* ``model_statistics``: ``ModelStatisticsResponse`` from the engine's
  ``InferenceTotals``: durations in nanoseconds, ``last_inference`` in
  milliseconds since the epoch. Every item the engine queued counts as one
  request (a request sent with a batch dimension of k counts k times, where Triton
  counts it once in ``inference_stats`` and k times in ``inference_count``).
  ``compute_input`` is the time in the model's ``collate``, ``compute_output`` in its
  ``split``, ``compute_infer`` the rest of the batch's device time (the forward pass; on
  a GPU the wait for its kernels falls in ``split``, which copies the outputs back).
* ``repository_index``: ``RepositoryIndexResponse.models``: name, version, state
  (``READY`` or ``UNAVAILABLE``) and reason of every request model.
"""

from __future__ import annotations

from typing import Any, Iterable

from runtime.api.errors import ModelNotFound

#: the one version every model is served under
MODEL_VERSION = "1"
#: Open Inference Protocol datatype -> Triton's ``DataType`` enum name
CONFIG_TYPES = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64", "BYTES": "TYPE_STRING",
}


def check_version(name: str, version: str | None) -> None:
    """``ModelNotFound`` unless ``version`` is None (any) or the served one."""
    if version is not None and version != MODEL_VERSION:
        raise ModelNotFound(f"model {name!r} has no version {version!r}; its only version is "
                            f"{MODEL_VERSION!r}")


def model_metadata(name: str, api: Any) -> dict[str, Any]:
    """The model's v2 metadata, its tensors' shapes led by the batch dimension (-1)."""
    meta = api.metadata()
    meta["name"] = name
    meta["versions"] = [MODEL_VERSION]
    for key in ("inputs", "outputs"):
        meta[key] = [{**t, "shape": [-1, *t["shape"]]} for t in meta.get(key, ())]
    return meta


def _us(ms: float | None) -> int:
    """Milliseconds (None: none) as Triton's whole microseconds (0: none)."""
    return 0 if ms is None else int(round(ms * 1000.0))


def model_config(engine: Any, name: str) -> dict[str, Any]:
    """The Triton ``ModelConfig`` of a served request model, from its live settings."""
    api = engine.model(name)
    version, cfg = engine.get_settings(name)
    device = engine.device
    gpu = getattr(device, "type", str(device)) == "cuda"
    group: dict[str, Any] = {"name": f"{name}_0", "kind": "KIND_GPU" if gpu else "KIND_CPU",
                             "count": 1}
    if gpu:
        group["gpus"] = [device.index or 0]
    return {
        "name": name,
        "platform": api.metadata().get("platform", "pytorch"),
        "backend": "batchscope",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": cfg.max_batch_size,
        "input": [{"name": s.name, "data_type": CONFIG_TYPES[s.datatype],
                   "format": "FORMAT_NONE", "dims": list(s.shape), "is_shape_tensor": False,
                   "allow_ragged_batch": False, "optional": s.optional} for s in api.inputs],
        "output": [{"name": s.name, "data_type": CONFIG_TYPES[s.datatype],
                    "dims": list(s.shape), "label_filename": "", "is_shape_tensor": False}
                   for s in api.outputs],
        "dynamic_batching": {
            "preferred_batch_size": list(cfg.preferred_batch_sizes),
            "max_queue_delay_microseconds": _us(cfg.max_queue_delay_ms),
            "preserve_ordering": False,
            "priority_levels": cfg.priority_levels,
            "default_priority_level": cfg.default_priority + 1,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": _us(cfg.default_timeout_ms),
                "allow_timeout_override": True,
                "max_queue_size": cfg.max_queue_size,
            },
        },
        "instance_group": [group],
        "parameters": {"batching_policy": {"string_value": cfg.policy},
                       "settings_version": {"string_value": str(version)}},
    }


def _duration(count: int, seconds: float) -> dict[str, int]:
    return {"count": count, "ns": int(round(seconds * 1e9))}


def _model_statistics(name: str, totals: Any) -> dict[str, Any]:
    ok = totals.success
    last = totals.last_success_at
    return {
        "name": name,
        "version": MODEL_VERSION,
        "last_inference": 0 if last is None else int(last * 1000.0),
        "inference_count": ok,
        "execution_count": totals.executions,
        "inference_stats": {
            "success": _duration(ok, totals.success_s),
            "fail": _duration(totals.fail, totals.fail_s),
            "queue": _duration(ok, totals.queue_s),
            "compute_input": _duration(ok, totals.input_s),
            "compute_infer": _duration(ok, totals.compute_s - totals.input_s - totals.output_s),
            "compute_output": _duration(ok, totals.output_s),
            "cache_hit": _duration(0, 0.0),
            "cache_miss": _duration(0, 0.0),
        },
        "batch_stats": [{"batch_size": size,
                         "compute_input": _duration(n, input_s),
                         "compute_infer": _duration(n, compute_s - input_s - output_s),
                         "compute_output": _duration(n, output_s)}
                        for size, (n, compute_s, input_s, output_s)
                        in sorted(totals.by_batch_size.items())],
        "memory_usage": [],
        "response_stats": {},
    }


def model_statistics(engine: Any, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Triton's statistics of ``names`` (default: every request model), in that order."""
    names = engine.model_names() if names is None else names
    return {"model_stats": [_model_statistics(name, engine.inference_totals(name))
                            for name in names]}


def repository_index(engine: Any, *, ready_only: bool = False) -> list[dict[str, str]]:
    """Every request model with its state; only the ready ones with ``ready_only``."""
    out = []
    for name in engine.model_names():
        ready = bool(engine.is_ready(name))
        if ready_only and not ready:
            continue
        out.append({"name": name, "version": MODEL_VERSION,
                    "state": "READY" if ready else "UNAVAILABLE",
                    "reason": "" if ready else "the model is loading or the server is stopping"})
    return out
