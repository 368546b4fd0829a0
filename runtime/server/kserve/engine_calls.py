"""A decoded request handed to the engine: ``run_infer`` (and ``submit_infer``, its
callback form) call ``Engine.infer`` for one item, ``Engine.infer_items`` for several.
The codec's only calls out; everything else in the package is pure."""

from __future__ import annotations

from typing import Any, Callable

from runtime.server.kserve.request import InferRequest, Result


async def run_infer(engine: Any, model: str, req: InferRequest, trace: Any = None) -> Result:
    """Run a decoded request through ``engine`` (the ``Engine`` contract): one item
    through ``Engine.infer``, several (``req.items``) through ``Engine.infer_items``.
    The answer is what ``encode_infer`` and ``response_tensors`` take. ``trace``: the
    request's ``RequestTrace`` when it is traced (passed on only then)."""
    if req.adapter is not None:
        if req.items is None:
            return await engine.infer(model, req.inputs, priority=req.priority,
                                      timeout_ms=req.timeout_ms, bypass=req.bypass, trace=trace,
                                      adapter=req.adapter)
        return await engine.infer_items(model, req.items, priority=req.priority,
                                        timeout_ms=req.timeout_ms, bypass=req.bypass,
                                        trace=trace, adapter=req.adapter)
    if trace is not None:
        if req.items is None:
            return await engine.infer(model, req.inputs, priority=req.priority,
                                      timeout_ms=req.timeout_ms, bypass=req.bypass, trace=trace)
        return await engine.infer_items(model, req.items, priority=req.priority,
                                        timeout_ms=req.timeout_ms, bypass=req.bypass,
                                        trace=trace)
    if req.items is None:
        return await engine.infer(model, req.inputs, priority=req.priority,
                                  timeout_ms=req.timeout_ms, bypass=req.bypass)
    return await engine.infer_items(model, req.items, priority=req.priority,
                                    timeout_ms=req.timeout_ms, bypass=req.bypass)


def submit_infer(engine: Any, model: str, req: InferRequest,
                 on_done: Callable[[Result | None, BaseException | None], None],
                 trace: Any = None) -> None:
    """``run_infer`` in the engine's callback form (``Engine.submit`` /
    ``Engine.submit_items``): admission errors are raised here, then exactly one
    ``on_done(result, None)`` or ``on_done(None, error)``."""
    if req.adapter is not None:
        if req.items is None:
            engine.submit(model, req.inputs, req.priority, req.timeout_ms, req.bypass, on_done,
                          trace, adapter=req.adapter)
        else:
            engine.submit_items(model, req.items, req.priority, req.timeout_ms, req.bypass,
                                on_done, trace, adapter=req.adapter)
        return
    if trace is not None:
        if req.items is None:
            engine.submit(model, req.inputs, req.priority, req.timeout_ms, req.bypass, on_done,
                          trace)
        else:
            engine.submit_items(model, req.items, req.priority, req.timeout_ms, req.bypass,
                                on_done, trace)
        return
    if req.items is None:
        engine.submit(model, req.inputs, req.priority, req.timeout_ms, req.bypass, on_done)
    else:
        engine.submit_items(model, req.items, req.priority, req.timeout_ms, req.bypass,
                            on_done)
