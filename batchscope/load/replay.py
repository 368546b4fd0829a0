"""Recorded traffic, replayed: arrival times, input shapes, timeouts and priorities of a
model's requests, read from a BatchScope database and sent again on the same schedule.

A request row holds when the request arrived (``arrived_at``), its length along the
variable dimension (``length``, None for fixed-shape inputs), its priority, whether it
asked for the bypass lane, and (rows written since schema version 5) the shape of each
of its inputs (``input_shape_json``) and the timeout it ran under (``timeout_ms``). The
input values are not recorded: each replayed request is synthesized from the model's
metadata, every input at its recorded shape when the row has one that fits the
metadata (same inputs, same rank, the fixed dimensions equal), else at the recorded
length (every ``-1`` dimension takes it); a text element gets ``length`` words. A
recorded timeout is sent as the request's ``timeout`` parameter, so requests expire
as they did. Every outcome counts as an arrival, refused and expired requests too,
since they were offered load all the same.

Raw request rows older than the retention window are folded into rollups and deleted,
so a replay reaches back at most ``batchscope serve --retention-raw-s``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from sqlalchemy import Engine, func, select

from batchscope.load.loadgen import LoadError, infer_body, is_variable_length
from batchscope.storage.schema import RequestRecord

#: the most recorded arrivals one replay reads
MAX_ARRIVALS = 100_000


@dataclass(frozen=True)
class RecordedTraffic:
    """One model's recorded arrivals, oldest first."""

    model: str
    #: arrival times in seconds after the first arrival
    offsets_s: tuple[float, ...]
    lengths: tuple[int | None, ...]
    #: HTTP priorities (1 = most urgent), as the requests would send them
    priorities: tuple[int, ...]
    bypass: tuple[bool, ...]
    #: per arrival: the recorded input shapes as JSON, and the timeout in ms (None: not
    #: recorded); empty: none recorded at all
    shapes_json: tuple[str | None, ...] = ()
    timeouts_ms: tuple[float | None, ...] = ()

    def __len__(self) -> int:
        return len(self.offsets_s)

    @property
    def duration_s(self) -> float:
        return self.offsets_s[-1] if self.offsets_s else 0.0

    @property
    def rate_rps(self) -> float:
        """Mean arrivals per second over the recording."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def max_length(self) -> int | None:
        known = [n for n in self.lengths if n is not None]
        return max(known) if known else None

    def describe(self) -> str:
        longest = self.max_length
        tail = f", lengths up to {longest}" if longest is not None else ""
        shaped = sum(v is not None for v in self.shapes_json)
        timed = sum(v is not None for v in self.timeouts_ms)
        if shaped:
            tail += f", {shaped} with their input shapes"
        if timed:
            tail += f", {timed} with their timeouts"
        return (f"{len(self)} recorded arrivals over {self.duration_s:.0f} s "
                f"({self.rate_rps:.1f}/s{tail})")


def read_traffic(engine: Engine, model: str, *, since: float | None = None,
                 until: float | None = None, instance_id: str | None = None,
                 limit: int = MAX_ARRIVALS) -> RecordedTraffic:
    """The newest ``limit`` arrivals of ``model`` between ``since`` and ``until`` (wall
    seconds); a ``LoadError`` when there are fewer than two."""
    query = select(RequestRecord.arrived_at, RequestRecord.length, RequestRecord.priority,
                   RequestRecord.bypass, RequestRecord.input_shape_json,
                   RequestRecord.timeout_ms).where(RequestRecord.model == model)
    if since is not None:
        query = query.where(RequestRecord.arrived_at >= since)
    if until is not None:
        query = query.where(RequestRecord.arrived_at <= until)
    if instance_id is not None:
        query = query.where(RequestRecord.instance_id == instance_id)
    with engine.connect() as conn:
        rows = conn.execute(query.order_by(RequestRecord.arrived_at.desc()).limit(limit)).all()
    if len(rows) < 2:
        raise LoadError(f"the database holds {len(rows)} recorded request(s) of model {model!r}"
                        f"{' in that window' if since or until else ''}; replay needs traffic "
                        "recorded by `batchscope serve` (with recording on), or use --load "
                        "synthetic")
    rows.reverse()
    first = float(rows[0][0])
    return RecordedTraffic(model=model,
                           offsets_s=tuple(float(r[0]) - first for r in rows),
                           lengths=tuple(None if r[1] is None else int(r[1]) for r in rows),
                           priorities=tuple(int(r[2]) + 1 for r in rows),
                           bypass=tuple(bool(r[3]) for r in rows),
                           shapes_json=tuple(r[4] for r in rows),
                           timeouts_ms=tuple(None if r[5] is None else round(float(r[5]), 3)
                                             for r in rows))


def shaped_metadata(metadata: dict, shapes_json: str | None) -> dict | None:
    """``metadata`` with each input's shape the recorded one, or None when the record
    does not fit it (not JSON, other inputs, another rank, a fixed dimension that
    differs, a dimension below 1): the caller then falls back to the length."""
    if not shapes_json:
        return None
    try:
        shapes = json.loads(shapes_json)
    except ValueError:
        return None
    inputs = metadata.get("inputs") or []
    if not isinstance(shapes, dict) or set(shapes) != {spec.get("name") for spec in inputs}:
        return None
    shaped = []
    for spec in inputs:
        declared, recorded = list(spec.get("shape", ())), shapes[spec["name"]]
        if not isinstance(recorded, list) or len(recorded) != len(declared) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 and (want in (-1, d))
                for d, want in zip(recorded, declared)):
            return None
        shaped.append({**spec, "shape": recorded})
    return {**metadata, "inputs": shaped}


def replay_arrivals(traffic: RecordedTraffic, metadata: dict, *, speed: float = 1.0,
                    seed: int = 0) -> Iterator[tuple[bytes, float]]:
    """``(infer body, seconds to the next arrival)`` following the recording, ``speed``
    times as fast, from its start again when it ends (the gap across the wrap is the
    recording's mean gap). Bodies are made once per (length, priority, bypass, shapes,
    timeout)."""
    if not speed > 0:
        raise LoadError(f"--replay-speed {speed!r} must be above 0")
    rng = np.random.default_rng(seed)
    bodies: dict[tuple, bytes] = {}
    offsets = traffic.offsets_s
    mean_gap = traffic.duration_s / max(1, len(offsets) - 1)
    variable = is_variable_length(metadata)
    shapes = traffic.shapes_json or itertools.repeat(None)
    timeouts = traffic.timeouts_ms or itertools.repeat(None)
    arrivals = list(zip(range(len(offsets)), shapes, timeouts))
    for i, shape, timeout_ms in itertools.cycle(arrivals):
        length = traffic.lengths[i] if variable else None
        key = (length, traffic.priorities[i], traffic.bypass[i], shape, timeout_ms)
        body = bodies.get(key)
        if body is None:
            body = bodies[key] = infer_body(shaped_metadata(metadata, shape) or metadata,
                                            length, rng, priority=key[1], bypass=key[2],
                                            timeout_ms=timeout_ms)
        gap = offsets[i + 1] - offsets[i] if i + 1 < len(offsets) else mean_gap
        yield body, max(0.0, gap) / speed


def recorded_lengths(engine: Engine, model: str, *, since: float | None = None,
                     instance_id: str | None = None) -> tuple[int, int] | None:
    """The shortest and longest recorded input length of ``model`` (since ``since``),
    or None when no request of it recorded one (fixed-shape inputs)."""
    query = select(func.min(RequestRecord.length), func.max(RequestRecord.length)).where(
        RequestRecord.model == model, RequestRecord.length.is_not(None))
    if since is not None:
        query = query.where(RequestRecord.arrived_at >= since)
    if instance_id is not None:
        query = query.where(RequestRecord.instance_id == instance_id)
    with engine.connect() as conn:
        low, high = conn.execute(query).one()
    return None if low is None else (int(low), int(high))
