"""``compile``: a model's ``predict`` through ``torch.compile``, in whichever process runs it.

The setting takes ``off`` or one of torch.compile's modes: ``default``,
``reduce-overhead`` (on CUDA, torch records CUDA graphs of the compiled code itself) or
``max-autotune`` (also searches kernel configurations: long compiles, fastest kernels).
``compiled_predict(model, mode)`` gives the callable ``run_batch`` uses, made once per
model and mode in the process that runs its batches (the device process, or the
serving process' device thread) and kept while the mode stays.

Compiling happens when the setting takes effect, on the first batch after it: before
that batch runs, ``warm_up`` runs the compiled ``predict`` on synthetic batches of
different sizes and lengths (made from the declared inputs), so torch compiles once,
once more with the batch and length dimensions dynamic, and once for a batch of one
(torch specialises sizes 0 and 1); later batches of any size reuse those graphs (a
request of length 1 compiles one more, on first use). A model that refuses synthetic inputs compiles on its first
real batches instead. Either way the time is booked as a ``compile`` event (from
dynamo's counters), the batch that carried the setting runs without an execution
timeout. With device processes (one per model) the other models keep serving while it
compiles; models sharing a device thread wait, so there turn ``compile`` on at start
(``--set NAME.compile=default``), not under load.

How it relates to ``cuda_graphs``: both remove per-batch launch overhead on a GPU;
``cuda_graphs`` replays graphs of the eager model captured per batch size by the
runtime, ``reduce-overhead`` has torch capture graphs of the compiled model. Turn on
one, not both: with ``compile`` on, ``cuda_graphs`` is ignored for that model. On the
CPU, ``default`` fuses element-wise work into C++ kernels; whether that pays off is
model-specific (``benchmarks/bench_compile.py`` measures it per model and batch size).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from runtime.api.model import DATATYPES

MODES = ("off", "default", "reduce-overhead", "max-autotune")
#: (batch size, length) of the warm-up batches: two shapes that differ in both, so the
#: second compile leaves both dimensions dynamic, then a batch of one (torch gives sizes
#: 0 and 1 graphs of their own) with the length already dynamic
WARM_UP_SHAPES = ((2, 8), (3, 16), (1, 8))

log = logging.getLogger("batchscope.compile")
_compiled: "weakref.WeakKeyDictionary[Any, tuple[str, Callable]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@dataclass(slots=True)
class Compiled:
    predict: Callable
    #: seconds spent compiling when it was made (the warm-up); 0 when reused
    warm_up_s: float = 0.0
    #: why compiling failed when it was made (``predict`` is then the eager one)
    error: str | None = None


def compiled_already(model: Any, mode: str) -> bool:
    """Whether ``model`` is compiled (or tried) with ``mode`` in this process: the next
    batch will not compile it from scratch."""
    held = _compiled.get(model)
    return mode == "off" or (held is not None and held[0] == mode)


def compiled_predict(model: Any, mode: str, clock: Any) -> Compiled | None:
    """``model.predict`` compiled with ``mode`` (None for ``off``); the first call for a
    model and mode compiles it on synthetic batches (``warm_up``) before returning. When
    torch cannot compile it (no C++ compiler, an operation inductor lacks), the model
    stays eager and ``error`` says why, once."""
    if mode == "off":
        return None
    with _lock:
        held = _compiled.get(model)
        if held is not None and held[0] == mode:
            return Compiled(held[1])
        fn = _compiled_fn(model, mode)
        started = clock.now()
        try:
            in_own_thread(lambda: warm_up(model, fn))
        except CompileFailed as exc:
            # some torch versions fail on inference tensors (torch 2.11): the compiled
            # model gets ordinary tensors instead, if that compiles
            fn = _compiled_fn(model, mode, outside_inference=True)
            if not INFERENCE_TROUBLE.search(str(exc)) or not compiles(model, fn):
                _compiled[model] = (mode, model.predict)
                return Compiled(model.predict, clock.now() - started, str(exc))
            log.info("model %s compiled (%s) to run outside inference mode: under it, %s",
                     getattr(model, "name", "?"), mode, exc)
        _compiled[model] = (mode, fn)
        return Compiled(fn, clock.now() - started)


def _compiled_fn(model: Any, mode: str, *, outside_inference: bool = False) -> Callable:
    """``model.predict`` through ``torch.compile``, or the predict a model that says what
    to compile makes (``predict_compiled_with(compile, outside_inference)``: a model whose
    batches are numpy arrays compiles its torch module, not the conversion around it);
    ``outside_inference``: run outside inference mode (see ``outside_inference_mode``)."""
    import torch

    make = getattr(model, "predict_compiled_with", None)
    if make is not None:
        return on_any_thread(make(lambda f: torch.compile(f, mode=mode), outside_inference))
    fn = torch.compile(model.predict, mode=mode)
    return on_any_thread(outside_inference_mode(fn) if outside_inference else fn)


#: what a compile failure that inference tensors may cause says
INFERENCE_TROUBLE = re.compile(r"inference|UntypedStorage", re.IGNORECASE)


def compiles(model: Any, fn: Callable) -> bool:
    """Whether ``fn`` (the model compiled) runs the warm-up batches and compiles at least
    one graph doing so (dynamo may skip a frame it cannot trace: nothing compiled)."""
    before = compiled_frames()
    try:
        ran = in_own_thread(lambda: warm_up(model, fn))
    except CompileFailed:
        return False
    return bool(ran) and compiled_frames() > before


def in_own_thread(work: Callable[[], Any]) -> Any:
    """``work()`` on a thread of its own, its result or its exception. A compile that
    fails inside inductor can leave the calling thread's dispatcher state broken (torch
    2.11: every later tensor operation on that thread raised "PythonDispatcherTLS was
    not set"), so the thread that serves the model never compiles it itself. The thread
    takes the caller's dynamo and inductor settings and CUDA device (all three are per
    thread in torch). With ``reduce-overhead`` torch keeps its CUDA graphs per thread:
    the serving thread records its own on its first batches of each size."""
    import torch

    box: dict[str, Any] = {}
    modules = _config_modules()
    wanted = [m.get_config_copy() for m in modules]  # torch's configs are per thread
    # the current CUDA device is per thread too (a device process sets its own)
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with contextlib.ExitStack() as stack:
                for module, want in zip(modules, wanted):
                    changed = _differing(module.get_config_copy(), want)
                    if changed:
                        stack.enter_context(module.patch(changed))
                box["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="batchscope-compile", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _config_modules() -> list[Any]:
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    return [dynamo, inductor]


def _differing(have: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """The settings of ``want`` whose values differ from ``have``."""
    out = {}
    for key, value in want.items():
        try:
            same = bool(have.get(key) == value)
        except Exception:  # noqa: BLE001 - a value without a plain equality
            same = False
        if not same:
            out[key] = value
    return out


_thread_ready = threading.local()


def on_any_thread(fn: Callable) -> Callable:
    """``fn`` (compiled) callable from any thread: the first call on a thread gives it
    the per-thread state torch's CUDA graphs need (``graph_trees_on_this_thread``)."""

    @functools.wraps(fn)
    def call(batch: Any) -> Any:
        if not getattr(_thread_ready, "done", False):
            graph_trees_on_this_thread()
        return fn(batch)

    return call


def graph_trees_on_this_thread() -> None:
    """Give this thread the state of torch's CUDA graph trees (``reduce-overhead``).

    Torch keeps one tree manager per device in a ``threading.local`` that it fills on
    the thread that imports it, and copies to autograd's threads only. In torch 2.11 a
    compiled ``reduce-overhead`` model run on any other thread (the device thread, the
    compile thread, the direct lane's thread) failed its first batch with a bare
    ``AssertionError`` (``torch._C._is_key_in_tls``); later versions fill a new
    thread's state on first use, as this does. Each thread then records its own graphs."""
    _thread_ready.done = True
    try:
        from torch._inductor import cudagraph_trees as trees
    except ImportError:  # a torch without inductor: nothing to prepare
        return
    import torch

    if hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    start = getattr(trees, "_initialize_tls", None)
    if start is not None:
        start(trees.local)
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", trees.local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)


def outside_inference_mode(fn: Callable) -> Callable:
    """``fn`` called with grad off but outside inference mode, on ordinary copies of
    the batch's inference tensors (the batch is collated under inference mode)."""
    from runtime.device.cudagraphs import flatten  # tensors, tuples, lists, dicts, dataclasses

    import torch

    def call(batch: Any) -> Any:
        with torch.inference_mode(False), torch.no_grad():
            leaves, rebuild = flatten(batch)
            return fn(rebuild([t.clone() if t.is_inference() else t for t in leaves]))

    return call


class CompileFailed(Exception):
    """The model runs eagerly on a synthetic batch but not compiled."""


def synthetic_inputs(model: Any, length: int) -> dict[str, np.ndarray] | None:
    """One request's inputs of the declared shapes (variable axes ``length`` long):
    zeros, or the text "a" for BYTES; None when an input's shape cannot be made."""
    out: dict[str, np.ndarray] = {}
    for spec in model.inputs:
        if getattr(spec, "optional", False) and out:
            continue
        shape = tuple(length if d == -1 else d for d in spec.shape)
        if spec.datatype == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr[...] = b"a " * (length // 2)
        else:
            arr = np.zeros(shape, dtype=DATATYPES[spec.datatype])
        out[spec.name] = arr
    return out or None


def warm_up(model: Any, fn: Callable) -> int:
    """Run ``fn`` on synthetic batches of ``WARM_UP_SHAPES`` so that compiling happens
    now rather than inside a client's batch; how many ran (0: the model refused the
    synthetic inputs, and compiling happens on the first batches instead). Raises
    ``CompileFailed`` when the eager model runs a batch the compiled one fails on."""
    import torch

    limit = getattr(model, "max_length", None) or 16
    ran = 0
    for n, length in WARM_UP_SHAPES:
        inputs = synthetic_inputs(model, min(length, limit))
        try:
            item = model.decode(inputs)
            with torch.inference_mode():  # as run_batch collates: same tensor kind, same guards
                batch = model.collate([item] * n, None)
                model.predict(batch)
        except Exception:  # noqa: BLE001 - a model may refuse made-up inputs
            return ran
        try:
            with torch.inference_mode():
                fn(batch)
        except Exception as exc:  # noqa: BLE001 - eager ran: the compiler failed
            raise CompileFailed(describe_failure(exc)) from None
        ran += 1
    return ran


#: the longest reason a compile failure gives (events and logs carry it)
MAX_REASON_CHARS = 600


def describe_failure(exc: BaseException) -> str:
    """Why compiling failed, in a line: the error's type and its message's lines up to
    torch's advice on logging. A backend error (``BackendCompilerFailed``) says only
    "backend='inductor' raised:" on its first line; the cause is on the next ones."""
    lines = []
    for line in str(exc).strip().splitlines():
        line = line.strip()
        if line.startswith(("Set TORCH_LOGS", "You can suppress", "For even more", "Set TORCHDYNAMO")):
            break
        if line:
            lines.append(line)
    return f"{type(exc).__name__}: {' '.join(lines)}"[:MAX_REASON_CHARS]


def compiled_frames() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0
    return int(counters["stats"].get("unique_graphs", 0))
