"""What a load sends: its options read (``parse_lengths``, ``parse_priority``) and the
request bodies drawn from a model's KServe v2 metadata (``build_payloads``: a pool of
``PAYLOAD_POOL`` bodies, inputs of random values, variable lengths drawn as the
``lengths`` option says). ``LoadError`` is what a load that cannot be set up raises."""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

import numpy as np
import orjson

PAYLOAD_POOL = 256


class LoadError(ValueError):
    """The load could not be set up (bad option, unreachable server, unknown model).
    The text says what was wrong and what to do; callers answer it as a usage error."""

    http_status = 400

    @property
    def message(self) -> str:
        return str(self)


# -- options parsing ------------------------------------------------------------------
def parse_lengths(spec: str | None) -> tuple[str, tuple[int, ...]] | None:
    """``uniform:LO:HI``, ``fixed:N`` or ``choice:A,B,C`` -> (kind, numbers)."""
    if spec is None:
        return None
    kind, _, rest = spec.partition(":")
    try:
        nums = tuple(int(x) for x in rest.replace(",", ":").split(":") if x)
    except ValueError:
        nums = ()
    ok = (kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]) or \
         (kind == "fixed" and len(nums) == 1 and nums[0] >= 1) or \
         (kind == "choice" and nums and min(nums) >= 1)
    if not ok:
        raise LoadError(f"--lengths {spec!r} is not understood; write uniform:8:128, fixed:64 "
                        "or choice:16,64,128 (positive token counts)")
    return kind, nums


def longest_length(spec: str | None) -> int | None:
    """The longest length ``spec`` (as ``parse_lengths`` reads it) can draw; None without one."""
    parsed = parse_lengths(spec)
    return None if parsed is None else max(parsed[1])


def parse_priority(spec: str | int | None) -> list[tuple[int, float]] | None:
    """``2`` or a weighted mix ``1=0.1,2=0.6,3=0.3`` (HTTP priorities: 1 = most urgent)."""
    if spec is None:
        return None
    if isinstance(spec, int):
        return [(spec, 1.0)]
    mix: list[tuple[int, float]] = []
    try:
        for part in str(spec).split(","):
            level, _, weight = part.partition("=")
            mix.append((int(level), float(weight) if weight else 1.0))
    except ValueError:
        mix = []
    if not mix or any(lv < 0 or w <= 0 for lv, w in mix):
        raise LoadError(f"--priority {spec!r} is not understood; write 2, or a weighted mix "
                        "like 1=0.1,2=0.6,3=0.3 (1 = most urgent)")
    return mix


# -- payloads -------------------------------------------------------------------------
def _tensor_data(datatype: str, shape: list[int], rng: np.random.Generator,
                 words: int | None) -> list:
    n = math.prod(shape)
    if datatype.startswith("FP"):
        return np.round(rng.standard_normal(n), 3).tolist()
    if datatype.startswith(("INT", "UINT")):
        return rng.integers(1, 100, n).tolist()
    if datatype == "BOOL":
        return rng.integers(0, 2, n).astype(bool).tolist()
    # text: a drawn length is the number of words of each element
    return [" ".join(["word"] * words) if words else "x"] * n


def infer_body(metadata: dict, length: int | None, rng: np.random.Generator, *,
               priority: int | None = None, timeout_ms: float | None = None,
               bypass: bool = False, adapter: str | None = None) -> bytes:
    """One JSON ``/infer`` body for the model of ``metadata``: every variable dimension
    (``-1``) is ``length`` (64 when None), text elements hold ``length`` words;
    ``adapter``: the LoRA adapter the request names (None: the base model)."""
    inputs = metadata.get("inputs") or []
    if not inputs:
        raise LoadError(f"model {metadata.get('name')!r} lists no inputs in its metadata")
    tensors = []
    for spec in inputs:
        shape = [(length or 64) if d == -1 else d for d in spec["shape"]]
        tensors.append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"],
                        "data": _tensor_data(spec["datatype"], shape, rng, length)})
    params: dict[str, Any] = {}
    if priority is not None:
        params["priority"] = priority
    if timeout_ms is not None:
        params["timeout"] = int(timeout_ms * 1000)
    if bypass:
        params["realtime"] = True
    if adapter is not None:
        params["adapter"] = adapter
    doc: dict[str, Any] = {"inputs": tensors}
    if params:
        doc["parameters"] = params
    return orjson.dumps(doc)


def is_variable_length(metadata: dict) -> bool:
    """Whether some input of the model of ``metadata`` has a variable dimension."""
    return any(-1 in spec.get("shape", ()) for spec in metadata.get("inputs") or [])


def build_payloads(metadata: dict, *, lengths: str | None = None, priority: str | int | None = None,
                   timeout_ms: float | None = None, bypass: bool = False, seed: int = 0,
                   pool: int = PAYLOAD_POOL,
                   adapters: Sequence[str | None] = ()) -> list[bytes]:
    """JSON ``/infer`` bodies for the model described by ``metadata`` (v2 model metadata);
    with ``adapters``, each body names one drawn evenly from them (None: the base model)."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    length_spec = parse_lengths(lengths)
    mix = parse_priority(priority)
    if not metadata.get("inputs"):
        raise LoadError(f"model {metadata.get('name')!r} lists no inputs in its metadata")
    variable = is_variable_length(metadata) or length_spec is not None
    count = pool if (variable or (mix and len(mix) > 1) or len(adapters) > 1) else min(pool, 16)
    bodies = []
    for _ in range(count):
        length = None
        if length_spec is not None:
            kind, nums = length_spec
            length = (pick.randint(nums[0], nums[1]) if kind == "uniform"
                      else nums[0] if kind == "fixed" else pick.choice(nums))
        level = pick.choices([lv for lv, _ in mix], [w for _, w in mix])[0] if mix else None
        adapter = pick.choice(adapters) if adapters else None
        bodies.append(infer_body(metadata, length, rng, priority=level, timeout_ms=timeout_ms,
                                 bypass=bypass, adapter=adapter))
    return bodies


def item_metadata(metadata: dict, config: dict | None) -> dict:
    """``metadata`` with each tensor's shape that of one item. A server that also
    answers Triton's ``/config`` with ``max_batch_size > 0`` leads every metadata shape
    with the batch dimension (-1), as Triton does: that dimension is dropped, so the
    ``-1`` left are variable lengths."""
    if not config or not isinstance(config.get("max_batch_size"), int) \
            or config["max_batch_size"] <= 0:
        return metadata
    out = dict(metadata)
    for key in ("inputs", "outputs"):
        out[key] = [{**t, "shape": list(t.get("shape", ()))[1:]} for t in metadata.get(key) or []]
    return out
