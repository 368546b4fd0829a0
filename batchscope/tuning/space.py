"""The search space of a tuning session, and how a point of it becomes settings.

A *point* is the JSON object of the tuned settings themselves, e.g.
``{"policy": "dynamic", "max_batch_size": 32, "max_queue_delay_ms": null,
"preferred_batch_sizes": [], "bucket_edges": [16, 32, 48], "max_batch_tokens": 1024}``;
trials, the grid and the result all speak in points. Which settings are tuned comes from
the model's ``GET /v2/models/{name}/batching`` document (a setting the model does not list
is left out) and its metadata (bucket edges and the token limit per batch only for a model
with a variable-length input: a token limit lets short requests fill a large batch while
long ones run in smaller batches, which no single ``max_batch_size`` does).

The values are discrete and ordered, the same for the optimizer and the grid, so a
session and an exhaustive grid search exactly the same space. The starting value of
each setting is always among its candidates, so the starting settings are a point of
the space (the first one measured). ``max_queue_delay_ms`` matters only for the
dynamic policy: under another policy it keeps its starting value.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from batchscope import settings as schema
from batchscope.load.loadgen import is_variable_length

POLICIES: tuple[str, ...] = ("dynamic", "adaptive", "static")
MAX_BATCH_SIZES: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
#: None is work-conserving: an idle model runs a request at once
QUEUE_DELAYS_MS: tuple[float | None, ...] = (None, 1.0, 2.0, 5.0, 10.0)
#: preferred batch sizes: none, or every power of two up to the max batch size
PREFERRED: tuple[str, ...] = ("none", "powers_of_two")
#: bucket edges every this many tokens, up to the longest expected length
EDGE_STEPS: tuple[int, ...] = (8, 16, 32)
#: token limits per batch, in multiples of the longest expected length (null: no limit)
TOKEN_MULTIPLES: tuple[int, ...] = (4, 8, 16)
START = "start"
#: bucket edges null: derived by the server from the lengths it sees
AUTO = "auto"
#: how far bucket edges reach when neither the load nor the settings say
DEFAULT_LONGEST = 256
TUNED = ("policy", "max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes",
         "bucket_edges", "max_batch_tokens")
_MAX_EDGES = next(s.max_items for s in schema.BATCHING if s.name == "bucket_edges") or 64


class SpaceError(ValueError):
    """A search space that cannot be built from the options given."""


def parse_values(text: str, kind: str, flag: str) -> tuple:
    """A comma-separated option list of the CLI: ints, floats or ints with ``none`` (=
    null), or words."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise SpaceError(f"{flag} {text!r} is empty; give a comma-separated list")
    try:
        if kind == "int":
            return tuple(int(item) for item in items)
        if kind in ("delay", "int_or_none"):
            number = float if kind == "delay" else int
            return tuple(None if item.lower() in ("none", "null") else number(item)
                         for item in items)
    except ValueError:
        example = {"int": "8,16,32", "delay": "none,2,5"}.get(kind, "none,512,1024")
        raise SpaceError(f"{flag} {text!r} is not understood; write e.g. {example}") from None
    return tuple(items)


@dataclass(frozen=True)
class SpaceOptions:
    """The candidate values a user asks for (the starting values are always added)."""

    policies: tuple[str, ...] = POLICIES
    max_batch_sizes: tuple[int, ...] = MAX_BATCH_SIZES
    queue_delays_ms: tuple[float | None, ...] = QUEUE_DELAYS_MS
    preferred: tuple[str, ...] = PREFERRED
    edge_steps: tuple[int, ...] = EDGE_STEPS
    #: token limits per batch (None in it: no limit); None: null and ``TOKEN_MULTIPLES``
    #: times the longest expected length; empty: the starting value only (not tuned)
    batch_tokens: tuple[int | None, ...] | None = None

    def check(self) -> "SpaceOptions":
        policy = schema.setting("request", "policy")
        bad = [p for p in self.policies if policy is not None and p not in policy.choices]
        if bad or not self.policies:
            raise SpaceError(f"--policies {','.join(self.policies)!r}: use some of "
                             f"{', '.join(policy.choices if policy else POLICIES)}")
        for name, values in (("max_batch_size", self.max_batch_sizes),
                             ("max_queue_delay_ms", self.queue_delays_ms),
                             ("max_batch_tokens", self.batch_tokens or (None,))):
            setting = schema.setting("request", name)
            problems = [setting.problem(v) for v in values] if setting else []
            problem = next((p for p in problems if p), None)
            if problem or not values:
                raise SpaceError(f"candidate values for {name}: {problem or 'none given'}")
        if any(p not in PREFERRED for p in self.preferred):
            raise SpaceError(f"preferred batch size options {list(self.preferred)}: use some "
                             f"of {', '.join(PREFERRED)}")
        if any(step < 1 for step in self.edge_steps):
            raise SpaceError(f"bucket edge steps {list(self.edge_steps)} must be positive")
        return self


def powers_of_two(limit: int) -> list[int]:
    """Every power of two from 2 up to ``limit``."""
    return [2 ** k for k in range(1, 13) if 2 ** k <= limit]


def edges_every(step: int, longest: int) -> list[int]:
    """Bucket edges ``step, 2 step, ...`` up to the first at or past ``longest``; the
    step is widened when that would be more edges than a model takes."""
    count = max(1, math.ceil(longest / step))
    while count > _MAX_EDGES:
        step *= 2
        count = max(1, math.ceil(longest / step))
    return [step * k for k in range(1, count + 1)]


def _with(values: Sequence, extra: Any) -> tuple:
    """``values`` with ``extra`` added, each once, in order (None first)."""
    merged = list(dict.fromkeys([*values, extra]))
    return tuple(sorted(merged, key=lambda v: (v is not None, v if v is not None else 0)))


def point_key(point: dict) -> str:
    """A point's identity: its JSON with sorted keys."""
    return json.dumps(point, sort_keys=True)


@dataclass(frozen=True)
class SearchSpace:
    """The tuned settings of one model and their candidate values."""

    #: the tuned settings' starting values (a point)
    start: dict
    policies: tuple[str, ...] = ()
    max_batch_sizes: tuple[int, ...] = ()
    queue_delays_ms: tuple[float | None, ...] = ()
    #: preferred batch size options: "start", "none", "powers_of_two" (empty: not tuned)
    preferred: tuple[str, ...] = ()
    #: bucket edge options by label ("start", "auto", "16", ...; None: derived by the
    #: server); empty for fixed-length models
    bucket_edges: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    #: token limits per batch (None: no limit); empty when not tuned
    batch_tokens: tuple[int | None, ...] = ()

    @classmethod
    def for_model(cls, batching_doc: dict, metadata: dict, *, longest_length: int | None = None,
                  options: SpaceOptions = SpaceOptions()) -> "SearchSpace":
        """The space of the model whose settings document (``GET .../batching``) and
        metadata (``GET /v2/models/{name}``) are given; ``longest_length``: the longest
        input the load will send (bucket edges reach it), else the last starting edge."""
        options.check()
        current = batching_doc.get("settings") or {}
        if current.get("autopilot_slo_p99_ms") is not None:
            raise SpaceError(f"the autopilot runs model {batching_doc.get('model')!r} "
                             f"(autopilot_slo_p99_ms={current['autopilot_slo_p99_ms']:g}) and "
                             "would fight the session's trials; set autopilot_slo_p99_ms to "
                             "null first, or leave the tuning to the autopilot")
        has = {name for name in TUNED if name in current}
        if "policy" not in has or "max_batch_size" not in has:
            raise SpaceError(f"model {batching_doc.get('model')!r} has no policy and "
                             "max_batch_size settings to tune; tuning covers request models")
        start = {name: current[name] for name in TUNED if name in has}
        if "preferred_batch_sizes" in start:
            start["preferred_batch_sizes"] = list(start["preferred_batch_sizes"] or [])
        variable = is_variable_length(metadata)
        edges: dict[str, tuple[int, ...] | None] = {}
        if "bucket_edges" in has and variable:
            own = current["bucket_edges"]
            start["bucket_edges"] = None if own is None else list(own)
            edges[START] = None if own is None else tuple(own)
            # a server that derives edges from the lengths it sees takes null
            if own is not None and "auto_bucket_count" in current:
                edges[AUTO] = None
            longest = longest_length or (max(own) if own else DEFAULT_LONGEST)
            for step in options.edge_steps:
                candidate = tuple(edges_every(step, longest))
                if candidate not in edges.values():
                    edges[str(step)] = candidate
        else:
            start.pop("bucket_edges", None)
        tokens: tuple[int | None, ...] = ()
        if "max_batch_tokens" in has and variable:
            longest = longest_length or max(edges.get(START) or (DEFAULT_LONGEST,))
            wanted = (options.batch_tokens if options.batch_tokens is not None
                      else (None, *(m * longest for m in TOKEN_MULTIPLES)))
            tokens = _with(wanted, start["max_batch_tokens"]) if wanted else ()
        else:
            start.pop("max_batch_tokens", None)
        preferred: tuple[str, ...] = ()
        if "preferred_batch_sizes" in has:
            own = START if start["preferred_batch_sizes"] else "none"
            preferred = tuple(dict.fromkeys((own, *options.preferred)))
        return cls(start=start,
                   policies=tuple(dict.fromkeys((start["policy"], *options.policies))),
                   max_batch_sizes=_with(options.max_batch_sizes, start["max_batch_size"]),
                   queue_delays_ms=(_with(options.queue_delays_ms, start["max_queue_delay_ms"])
                                    if "max_queue_delay_ms" in has else ()),
                   preferred=preferred, bucket_edges=edges, batch_tokens=tokens)

    # -- points -----------------------------------------------------------------------
    def point(self, policy: str, max_batch_size: int, delay_ms: float | None = None,
              preferred: str | None = None, edges: str | None = None,
              tokens: int | None | str = START) -> dict:
        """The point of these choices (irrelevant ones take their starting values;
        ``tokens``: a token limit, None for none, ``START`` for the starting one)."""
        point: dict[str, Any] = {"policy": policy, "max_batch_size": max_batch_size}
        if "max_queue_delay_ms" in self.start:
            point["max_queue_delay_ms"] = (delay_ms if policy == "dynamic"
                                           else self.start["max_queue_delay_ms"])
        if "preferred_batch_sizes" in self.start:
            if preferred == START:
                sizes = [s for s in self.start["preferred_batch_sizes"] if s <= max_batch_size]
            elif preferred == "powers_of_two":
                sizes = powers_of_two(max_batch_size)
            else:
                sizes = []
            point["preferred_batch_sizes"] = sizes
        if self.bucket_edges:
            chosen = self.bucket_edges[edges or START]
            point["bucket_edges"] = None if chosen is None else list(chosen)
        if "max_batch_tokens" in self.start:
            point["max_batch_tokens"] = (self.start["max_batch_tokens"] if tokens == START
                                         else tokens)
        return point

    def grid(self) -> list[dict]:
        """Every distinct point, the starting one first."""
        delays = self.queue_delays_ms or (None,)
        seen = {point_key(self.start)}
        points = [dict(self.start)]
        for policy, size, pref, edges, tokens in itertools.product(
                self.policies, self.max_batch_sizes, self.preferred or (None,),
                tuple(self.bucket_edges) or (None,), self.batch_tokens or (START,)):
            for delay in (delays if policy == "dynamic" else (None,)):
                point = self.point(policy, size, delay, pref, edges, tokens)
                if point_key(point) not in seen:
                    seen.add(point_key(point))
                    points.append(point)
        return points

    def size(self) -> int:
        return len(self.grid())

    # -- the optimizer's parameters ----------------------------------------------------
    def suggest(self, trial: Any) -> dict:
        """The point an Optuna trial (define-by-run) picks: ordered values as indices,
        the delay asked only under the dynamic policy."""
        policy = trial.suggest_categorical("policy", list(self.policies))
        size = self.max_batch_sizes[trial.suggest_int("max_batch_size_index", 0,
                                                      len(self.max_batch_sizes) - 1)]
        delay = None
        if policy == "dynamic" and self.queue_delays_ms:
            delay = self.queue_delays_ms[trial.suggest_int("max_queue_delay_index", 0,
                                                           len(self.queue_delays_ms) - 1)]
        pref = (trial.suggest_categorical("preferred_batch_sizes", list(self.preferred))
                if self.preferred else None)
        edges = (trial.suggest_categorical("bucket_edges", list(self.bucket_edges))
                 if self.bucket_edges else None)
        tokens: int | None | str = START
        if self.batch_tokens:
            tokens = self.batch_tokens[trial.suggest_int("max_batch_tokens_index", 0,
                                                         len(self.batch_tokens) - 1)]
        return self.point(policy, size, delay, pref, edges, tokens)

    def start_params(self) -> dict[str, Any]:
        """The optimizer's parameters of the starting point."""
        start = self.start
        params: dict[str, Any] = {
            "policy": start["policy"],
            "max_batch_size_index": self.max_batch_sizes.index(start["max_batch_size"])}
        if start["policy"] == "dynamic" and self.queue_delays_ms:
            params["max_queue_delay_index"] = self.queue_delays_ms.index(
                start["max_queue_delay_ms"])
        if self.preferred:
            params["preferred_batch_sizes"] = START if start["preferred_batch_sizes"] else "none"
        if self.bucket_edges:
            params["bucket_edges"] = START
        if self.batch_tokens:
            params["max_batch_tokens_index"] = self.batch_tokens.index(
                start["max_batch_tokens"])
        return params

    def describe(self) -> str:
        """The space in one line, e.g. for the start of a session's output."""
        parts = [f"policy {'/'.join(self.policies)}",
                 "max_batch_size " + ",".join(str(v) for v in self.max_batch_sizes)]
        if self.queue_delays_ms:
            parts.append("max_queue_delay_ms " + ",".join(
                "null" if v is None else f"{v:g}" for v in self.queue_delays_ms))
        if self.preferred:
            parts.append("preferred_batch_sizes " + "/".join(self.preferred))
        if self.bucket_edges:
            parts.append("bucket_edges " + "/".join(
                k if k in (START, AUTO) else f"every {k}" for k in self.bucket_edges))
        if self.batch_tokens:
            parts.append("max_batch_tokens " + ",".join(
                "null" if v is None else str(v) for v in self.batch_tokens))
        return "; ".join(parts) + f" ({self.size()} points)"


def changes_between(old: dict, new: dict) -> dict:
    """The settings of ``new`` whose values differ from ``old``."""
    return {k: v for k, v in new.items() if old.get(k, object()) != v}


def format_point(point: dict, keys: Sequence[str] | None = None) -> str:
    """``max_batch_size=64, max_queue_delay_ms=null`` (settings written as flags take them)."""
    parts = []
    for key in keys if keys is not None else list(point):
        setting = schema.setting("request", key)
        value = point[key]
        if setting is not None:
            text = setting.to_text(tuple(value) if isinstance(value, list) else value)
        else:
            text = json.dumps(value)
        parts.append(f"{key}={text or '[]'}")
    return ", ".join(parts)
