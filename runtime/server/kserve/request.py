"""The decoded request (``InferRequest``) and the checks that set its fields beyond the
arrays: scheduling parameters, the outputs asked for, the inputs against the model's
specs and their batch dimension.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from runtime.api.errors import ClientError, ValidationError
from runtime.api.model import TensorSpec
from runtime.server.bounds import Reservation
from runtime.server.kserve.inputs import _quote, _shape_text


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
        if name in names:
            raise ClientError(f"output {name!r} is asked for more than once; name each output "
                              "once")
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
