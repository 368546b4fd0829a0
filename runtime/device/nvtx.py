"""NVTX ranges around each batch's and each generation step's device work (``--nvtx``).

In Nsight Systems (``nsys profile -t cuda,nvtx ...``) every batch then shows as a range
``batch <id> <model> n=<size>`` in the ``batchscope`` domain above the kernels it
launched, its payload the batch id, the same number as the ``seq`` of its row in the
database, the batch slice of a trace export and ``batchscope.batch.id`` of its
OpenTelemetry span; a generation step shows as ``step <n> <model> running=<r>``.

The ranges come from the ``nvtx`` package when it is installed (its domain API, with
the payload), else from ``torch.cuda.nvtx`` on a CUDA build of torch (the id only in
the message), else not at all. Turned off (the default), or without CUDA or a profiler
attached, a range costs one attribute check; nothing here ever raises into the batch.

The switch is an environment variable (``BATCHSCOPE_NVTX=1``, set by ``--nvtx``) so that
device processes started by the server inherit it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager

ENV = "BATCHSCOPE_NVTX"
DOMAIN = "batchscope"


def _nothing(*_args: Any, **_kwargs: Any) -> ContextManager[None]:
    return contextlib.nullcontext()


def _guarded(push: Callable[[str, int | None], Any], pop: Callable[[], Any]
             ) -> Callable[..., ContextManager[Any]]:
    """``ranged(message, payload)`` from a push and a pop that may raise (they never
    reach the batch: a failed push leaves the range out)."""
    @contextlib.contextmanager
    def ranged(message: str, payload: int | None = None):
        try:
            push(message, payload)
        except Exception:  # noqa: BLE001 - never break the batch
            yield
            return
        try:
            yield
        finally:
            try:
                pop()
            except Exception:  # noqa: BLE001
                pass

    return ranged


def _from_nvtx_package() -> Callable[..., ContextManager[Any]] | None:
    try:
        import nvtx
        domain = nvtx.get_domain(DOMAIN)
    except Exception:  # noqa: BLE001 - not installed, or a build without domains
        return None
    attributes = _attributes(domain)
    return _guarded(lambda message, payload: domain.push_range(attributes(message, payload)),
                    domain.pop_range)


def _attributes(domain: Any) -> Callable[[str, int | None], Any]:
    """``attributes(message, payload)``: the event attributes of one range.

    ``Domain.get_event_attributes`` registers its message through an unbounded cache of
    every message it has seen, and each batch's message is new (it holds the batch id):
    with a profiler attached for hours, that cache would grow by a string per batch. The
    message is registered afresh instead and dropped with its range (the profiler keeps
    its own copy). Without a profiler the domain is nvtx's no-op one and takes the
    plain call."""
    try:
        from nvtx._lib.lib import EventAttributes, RegisteredString

        handle = domain.handle  # absent on the no-op domain
    except (ImportError, AttributeError):
        return lambda message, payload: domain.get_event_attributes(message=message, payload=payload)
    return lambda message, payload: EventAttributes(domain, RegisteredString(handle, message),
                                                    None, None, payload)


def _from_torch() -> Callable[..., ContextManager[Any]] | None:
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
        push("batchscope nvtx check")
        pop()
    except Exception:  # noqa: BLE001 - a CPU build: "NVTX functions not installed"
        return None
    return _guarded(lambda message, _payload: push(message), pop)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0", "false", "no")


def _make() -> tuple[Callable[..., ContextManager[Any]], str]:
    if not enabled():
        return _nothing, "off"
    for source, make in (("nvtx", _from_nvtx_package), ("torch.cuda.nvtx", _from_torch)):
        made = make()
        if made is not None:
            return made, source
    return _nothing, "off"


#: ``ranged(message, payload)``: a context manager around device work; SOURCE: where the
#: ranges come from ("nvtx", "torch.cuda.nvtx" or "off"); both set by ``reload``
ranged: Callable[..., ContextManager[Any]] = _nothing
SOURCE = "off"


def batch_range(seq: int | None, model: str, size: int) -> ContextManager[Any]:
    """The range of one batch's device work (``seq``: its batch id, None when unknown)."""
    if ranged is _nothing:
        return contextlib.nullcontext()
    return ranged(f"batch {seq if seq is not None else '?'} {model} n={size}", seq)


def step_range(step: int, model: str, running: int, prefill: int,
               decode: int) -> ContextManager[Any]:
    """The range of one generation step's device work."""
    if ranged is _nothing:
        return contextlib.nullcontext()
    return ranged(f"step {step} {model} running={running} prefill={prefill} decode={decode}",
                  step)


def reload() -> str:
    """Read ``BATCHSCOPE_NVTX`` again (after ``--nvtx`` set it); the source in use."""
    global ranged, SOURCE
    ranged, SOURCE = _make()
    return SOURCE


reload()
