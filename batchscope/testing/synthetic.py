"""Realistic recorded data without a running runtime.

A ``Scenario`` describes one model's traffic and behaviour (arrival of batches,
batch sizes, compute cost per batch size, queue waits, priorities, lengths,
failures). ``generate`` turns it into rows of every recorded table with numpy
(vectorised, so a million batches take seconds) and writes them with plain
``executemany`` on SQLite and ``COPY`` on PostgreSQL. ``SCENARIOS`` holds one preset per problem the diagnosis
rules look for, plus a healthy baseline; tests rely on the numbers being
exactly reproducible for a given ``seed``.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from sqlalchemy import Engine

from batchscope.storage import summaries
from batchscope.storage.schema import (BatchRecord, DeviceSample, EventRecord, GenerationStep,
                               ModelSettings, RequestRecord, RuntimeInstance)

GIB = 1024 ** 3


@dataclass(frozen=True)
class Scenario:
    """One model's recorded behaviour over ``duration_s`` seconds."""

    name: str = "healthy"
    model: str = "mlp"
    instance_id: str = "synthetic-1"
    duration_s: float = 900.0
    batches_per_s: float = 20.0
    policy: str = "dynamic"
    max_batch_size: int = 32
    #: batch size ~ Normal(mean, sd) clipped to [1, max_batch_size]
    batch_size_mean: float = 16.0
    batch_size_sd: float = 4.0
    #: compute_s = compute_base_s + compute_per_item_s * batch_size (+ jitter)
    compute_base_s: float = 0.010
    compute_per_item_s: float = 0.0002
    #: per-request queue wait ~ Uniform(0, queue_wait_max_s)
    queue_wait_max_s: float = 0.004
    #: probability that a request waits ``tail_wait_s`` longer than usual
    tail_fraction: float = 0.0
    tail_wait_s: float = 0.0
    priority_weights: tuple[float, ...] = (0.2, 0.6, 0.2)
    #: extra queue wait for each priority level (index = level)
    priority_extra_wait_s: tuple[float, ...] = ()
    #: fraction of requests at each priority that expire in the queue
    priority_expired_fraction: tuple[float, ...] = ()
    #: lengths for variable-length models (None = fixed-size inputs)
    bucket_edges: tuple[int, ...] | None = None
    length_max: int = 256
    pad_to_bucket: bool = False
    rejected_per_s: float = 0.0
    expired_per_s: float = 0.0
    #: queue depth ramp: start -> end over the window
    queue_depth_start: float = 2.0
    queue_depth_end: float = 2.0
    max_queue_size: int = 1024
    oom_events: int = 0
    memory_total_bytes: int = 16 * GIB
    memory_used_fraction: float = 0.45
    utilization_pct: float = 65.0
    #: settings changes during the window: (fraction of window, {field: new value})
    settings_changes: tuple[tuple[float, dict], ...] = ()
    generation: bool = False
    gen_steps_per_s: float = 20.0
    preemptions_per_step: float = 0.0
    max_queue_delay_ms: float | None = 5.0

    def with_(self, **changes) -> "Scenario":
        return dataclasses.replace(self, **changes)


@dataclass
class Generated:
    """What ``generate`` wrote, for tests that check exact numbers."""

    batches: int = 0
    requests: int = 0
    events: int = 0
    device_samples: int = 0
    generation_steps: int = 0
    start_s: float = 0.0
    end_s: float = 0.0
    latencies_ok_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    batch_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def _settings_dict(sc: Scenario, overrides: dict | None = None) -> dict:
    if sc.generation:  # a continuous-batching model publishes its scheduler settings
        return {"mode": "continuous", "block_size": 16, "num_cache_blocks": 512,
                "max_num_seqs": 24, "max_num_batched_tokens": 2048, "max_queue_size": 256,
                "default_timeout_ms": None, **(overrides or {})}
    out = {
        "policy": sc.policy, "max_batch_size": sc.max_batch_size,
        "max_queue_delay_ms": sc.max_queue_delay_ms, "preferred_batch_sizes": [],
        "bucketing": sc.bucket_edges is not None,
        "bucket_edges": list(sc.bucket_edges or (32, 64, 128, 256)),
        "pad_to": "bucket" if sc.pad_to_bucket else "batch_max",
        "max_queue_size": sc.max_queue_size, "priority_levels": len(sc.priority_weights),
        "default_priority": min(1, len(sc.priority_weights) - 1), "default_timeout_ms": None,
    }
    out.update(overrides or {})
    return out


class _Cursor:
    """A DBAPI cursor of SQLite (``?`` parameters, ``executemany``) or of psycopg
    (``%s`` parameters, rows streamed with ``COPY``)."""

    def __init__(self, cursor) -> None:
        self.cursor = cursor
        self.copy = hasattr(cursor, "copy")  # psycopg 3

    def execute(self, sql: str, params: tuple = ()) -> None:
        self.cursor.execute(sql.replace("?", "%s") if self.copy else sql, params)

    def summarise(self, table: str, after_id: int) -> None:
        """Add the rows of ``table`` with ids above ``after_id`` to the live summaries,
        as the recorder's inserts do."""
        for sql in summaries.STATEMENTS[table]("id > :after"):
            self.cursor.execute(sql.replace(":after", "%(after)s") if self.copy else sql,
                                {"after": after_id})

    def max_id(self, table: str) -> int:
        self.cursor.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}")
        return int(self.cursor.fetchone()[0])

    def fetchone(self):
        return self.cursor.fetchone()

    def insert(self, table: str, columns: Sequence[str], rows: Iterable[tuple]) -> None:
        cols = ", ".join(columns)
        if self.copy:
            with self.cursor.copy(f"COPY {table} ({cols}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            return
        marks = ", ".join("?" for _ in columns)
        self.cursor.executemany(f"INSERT INTO {table} ({cols}) VALUES ({marks})", rows)


def _insert(cur: _Cursor, table, columns: Sequence[str], rows: Iterable[tuple]) -> None:
    cur.insert(table.__tablename__, columns, rows)


def _py(values: np.ndarray) -> list:
    return values.tolist()


def generate(engine: Engine, scenario: Scenario, *, end_s: float, seed: int = 0,
             write_instance: bool = True) -> Generated:
    """Write ``scenario`` ending at wall time ``end_s`` into ``engine``'s database."""
    sc = scenario
    rng = np.random.default_rng(seed)
    start_s = end_s - sc.duration_s
    out = Generated(start_s=start_s, end_s=end_s)
    raw = engine.raw_connection()
    try:
        cur = _Cursor(raw.cursor())
        if write_instance:
            _write_instance(cur, sc, start_s, end_s)
        before = {table: cur.max_id(table) for table in summaries.STATEMENTS}
        _write_batches_and_requests(cur, sc, rng, start_s, out)
        for table, after_id in before.items():
            cur.summarise(table, after_id)
        _write_events(cur, sc, rng, start_s, out)
        _write_device(cur, sc, rng, start_s, out)
        if sc.generation:
            _write_generation(cur, sc, rng, start_s, out)
        raw.commit()
    finally:
        raw.close()
    return out


def _write_instance(cur, sc: Scenario, start_s: float, end_s: float) -> None:
    cur.execute(f"SELECT models_json FROM {RuntimeInstance.__tablename__} WHERE id = ?",
                (sc.instance_id,))
    row = cur.fetchone()
    models = sorted(set(json.loads(row[0]) if row else []) | {sc.model})
    cur.execute(f"DELETE FROM {RuntimeInstance.__tablename__} WHERE id = ?", (sc.instance_id,))
    _insert(cur, RuntimeInstance, ("id", "host", "pid", "models_json", "url", "device", "version",
                                   "started_at", "last_seen_at", "stopped_at", "records_dropped"),
            [(sc.instance_id, socket.gethostname(), 0, json.dumps(models), None, "cpu",
              "synthetic", start_s, end_s, None, 0)])
    final = {}
    for _, change in sc.settings_changes:
        final.update(change)
    cur.execute(f"DELETE FROM {ModelSettings.__tablename__} WHERE instance_id = ? AND model = ?",
                (sc.instance_id, sc.model))
    _insert(cur, ModelSettings, ("instance_id", "model", "version", "settings_json", "kind",
                                 "updated_at"),
            [(sc.instance_id, sc.model, 1 + len(sc.settings_changes),
              json.dumps(_settings_dict(sc, final)),
              "generate" if sc.generation else "request", end_s)])


def _max_size_over_time(sc: Scenario, frac: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Configured max batch size and settings version at each point of the window."""
    max_bs = np.full(frac.shape, sc.max_batch_size, dtype=np.int64)
    version = np.ones(frac.shape, dtype=np.int64)
    for i, (at_frac, change) in enumerate(sorted(sc.settings_changes, key=lambda c: c[0])):
        after = frac >= at_frac
        version[after] = i + 2
        if "max_batch_size" in change:
            max_bs[after] = int(change["max_batch_size"])
    return max_bs, version


def _write_batches_and_requests(cur, sc: Scenario, rng, start_s: float, out: Generated) -> None:
    n = max(1, int(round(sc.duration_s * sc.batches_per_s)))
    ended = np.sort(start_s + rng.uniform(0.0, sc.duration_s, n))
    max_bs, version = _max_size_over_time(sc, (ended - start_s) / sc.duration_s)
    sizes = np.rint(rng.normal(sc.batch_size_mean, sc.batch_size_sd, n)).astype(np.int64)
    sizes = np.clip(sizes, 1, max_bs)
    compute = (sc.compute_base_s + sc.compute_per_item_s * sizes) * rng.uniform(0.95, 1.05, n)
    started = ended - compute
    depth = np.rint(np.linspace(sc.queue_depth_start, sc.queue_depth_end, n)
                    + rng.uniform(-0.5, 0.5, n)).clip(0).astype(np.int64)

    # requests of each batch
    total = int(sizes.sum())
    owner = np.repeat(np.arange(n), sizes)
    levels = len(sc.priority_weights)
    weights = np.asarray(sc.priority_weights, dtype=float)
    prio = rng.choice(levels, size=total, p=weights / weights.sum())
    wait = rng.uniform(0.0, sc.queue_wait_max_s, total)
    if sc.priority_extra_wait_s:
        wait += np.asarray(sc.priority_extra_wait_s, dtype=float)[prio]
    if sc.tail_fraction > 0:
        wait += np.where(rng.uniform(size=total) < sc.tail_fraction, sc.tail_wait_s, 0.0)
    finished = ended[owner]
    latency = wait + compute[owner]
    lengths = None
    real = sizes.copy()
    padded = sizes.copy()
    bucket = np.full(n, -2, dtype=np.int64)
    if sc.bucket_edges is not None:
        lengths = rng.integers(1, sc.length_max + 1, total)
        edges = np.asarray(sc.bucket_edges)
        req_bucket = np.searchsorted(edges, lengths)  # index of the edge >= length
        # a batch takes the bucket of its first request; its requests are clipped to it
        first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        bidx = req_bucket[first]
        upper = np.where(bidx < len(edges), edges[np.minimum(bidx, len(edges) - 1)], sc.length_max)
        lower = np.where(bidx > 0, edges[np.maximum(bidx - 1, 0)], 0)
        lengths = np.clip(lengths, lower[owner] + 1, upper[owner])
        bucket = np.where(bidx < len(edges), upper, -1)
        real = np.bincount(owner, weights=lengths, minlength=n).astype(np.int64)
        longest = np.zeros(n, dtype=np.int64)
        np.maximum.at(longest, owner, lengths)
        pad_len = upper if sc.pad_to_bucket else longest
        padded = pad_len * sizes
    out.batch_sizes = sizes
    out.batches = n

    # wait statistics per batch, from its own requests
    wsum = np.bincount(owner, weights=wait, minlength=n)
    wmin = np.full(n, np.inf)
    np.minimum.at(wmin, owner, wait)
    wmax = np.zeros(n)
    np.maximum.at(wmax, owner, wait)
    seq = np.arange(1, n + 1)
    peak = (sc.memory_total_bytes * sc.memory_used_fraction * (0.5 + 0.5 * sizes / max_bs)).astype(np.int64)
    rows = zip([sc.instance_id] * n, [sc.model] * n, _py(seq), [sc.policy] * n, _py(version),
               _py(max_bs), [None if b == -2 else b for b in _py(bucket)], _py(sizes), _py(real),
               _py(padded), _py(wmin), _py(wsum / sizes), _py(wmax), _py(compute), _py(started),
               _py(ended), ["ok"] * n, _py(peak), [False] * n, _py(depth))
    _insert(cur, BatchRecord, ("instance_id", "model", "seq", "policy", "settings_version",
                               "max_batch_size", "bucket", "batch_size", "real_elements",
                               "padded_elements", "queue_wait_min_s", "queue_wait_mean_s",
                               "queue_wait_max_s", "compute_s", "started_at", "ended_at",
                               "outcome", "peak_memory_bytes", "cuda_graph", "queue_depth"), rows)

    outcome = np.full(total, "ok", dtype=object)
    if sc.priority_expired_fraction:
        frac = np.asarray(sc.priority_expired_fraction, dtype=float)[prio]
        outcome[rng.uniform(size=total) < frac] = "expired"
    out.latencies_ok_s = latency[outcome == "ok"]
    batch_seq = np.where(outcome == "ok", seq[owner], -1)
    arrived = finished - latency
    gen = sc.generation
    out_tokens = rng.integers(16, 128, total) if gen else None
    ttft = wait + compute[owner] * 0.3 if gen else None
    tpot = compute[owner] / 8 if gen else None
    req_cols = ("instance_id", "model", "batch_seq", "priority", "bypass", "length", "arrived_at",
                "finished_at", "queue_wait_s", "latency_s", "outcome", "ttft_s", "tpot_s",
                "prompt_tokens", "output_tokens")
    none = [None] * total
    rows = zip([sc.instance_id] * total, [sc.model] * total,
               [None if s < 0 else s for s in _py(batch_seq)], _py(prio), [False] * total,
               _py(lengths) if lengths is not None else none, _py(arrived), _py(finished),
               _py(wait), _py(latency), outcome.tolist(),
               _py(ttft) if gen else none, _py(tpot) if gen else none,
               _py(lengths if lengths is not None else out_tokens) if gen else none,
               _py(out_tokens) if gen else none)
    _insert(cur, RequestRecord, req_cols, rows)
    out.requests = total

    # refused and expired requests that never reached a batch
    extra = []
    for kind, rate in (("rejected", sc.rejected_per_s), ("expired", sc.expired_per_s)):
        k = int(round(rate * sc.duration_s))
        at = np.sort(start_s + rng.uniform(0.0, sc.duration_s, k))
        waited = np.zeros(k) if kind == "rejected" else rng.uniform(0.5, 1.0, k)
        extra += [(sc.instance_id, sc.model, None, 1, False, None, t - w, t, w, w, kind,
                   None, None, None, None) for t, w in zip(_py(at), _py(waited))]
    _insert(cur, RequestRecord, req_cols, extra)
    out.requests += len(extra)


def _write_events(cur, sc: Scenario, rng, start_s: float, out: Generated) -> None:
    cols = ("instance_id", "model", "at", "kind", "severity", "message", "details_json")
    rows = [(sc.instance_id, sc.model, start_s + 0.5, "started", "info",
             f"{sc.model} started", "{}")]
    old = _settings_dict(sc)
    for i, (at_frac, change) in enumerate(sorted(sc.settings_changes, key=lambda c: c[0])):
        new = dict(old, **change)
        details = {"old": {k: old.get(k) for k in change}, "new": change,
                   "requested_by": "synthetic", "version": i + 2}
        text = ", ".join(f"{k} {old.get(k)} -> {v}" for k, v in change.items())
        rows.append((sc.instance_id, sc.model, start_s + at_frac * sc.duration_s,
                     "settings_change", "info", f"settings v{i + 2}: {text}", json.dumps(details)))
        old = new
    for t in _py(np.sort(start_s + rng.uniform(0.1, 0.9, sc.oom_events) * sc.duration_s)):
        size = sc.max_batch_size
        details = {"batch_size": size, "peak_memory_bytes": int(sc.memory_total_bytes * 0.98),
                   "action": "split", "effective_max_batch_size": max(1, size // 2)}
        rows.append((sc.instance_id, sc.model, t, "oom", "error",
                     f"out of memory at batch size {size}; split and retried, effective max "
                     f"batch size now {max(1, size // 2)}", json.dumps(details)))
    _insert(cur, EventRecord, cols, rows)
    out.events = len(rows)


def _write_device(cur, sc: Scenario, rng, start_s: float, out: Generated) -> None:
    k = int(sc.duration_s)
    at = start_s + np.arange(k) + 0.5
    util = np.clip(sc.utilization_pct + rng.normal(0, 3, k), 0, 100)
    used = (sc.memory_total_bytes * np.clip(sc.memory_used_fraction + rng.normal(0, 0.01, k),
                                            0, 1)).astype(np.int64)
    rows = zip([sc.instance_id] * k, _py(at), ["cuda:0"] * k, ["gpu"] * k, _py(util), _py(used),
               [sc.memory_total_bytes] * k, _py(used // 2), _py(used * 3 // 4))
    _insert(cur, DeviceSample, ("instance_id", "at", "device", "kind", "utilization_pct",
                                "memory_used_bytes", "memory_total_bytes",
                                "torch_allocated_bytes", "torch_reserved_bytes"), rows)
    out.device_samples = k


def _write_generation(cur, sc: Scenario, rng, start_s: float, out: Generated) -> None:
    k = int(sc.duration_s * sc.gen_steps_per_s)
    at = start_s + np.sort(rng.uniform(0, sc.duration_s, k))
    running = rng.integers(4, 24, k)
    waiting = rng.integers(0, 8, k)
    prefill = np.where(rng.uniform(size=k) < 0.2, rng.integers(16, 256, k), 0)
    blocks_total = 512
    used = np.minimum(blocks_total, running * rng.integers(8, 20, k))
    preempt = rng.poisson(sc.preemptions_per_step, k)
    step = 0.004 + 0.0005 * running + 0.00002 * prefill
    rows = zip([sc.instance_id] * k, [sc.model] * k, _py(at), ["continuous"] * k, _py(running),
               _py(waiting), _py(prefill), _py(running), _py(used), _py(blocks_total - used),
               _py(preempt), _py(step))
    _insert(cur, GenerationStep, ("instance_id", "model", "at", "mode", "running", "waiting",
                                  "prefill_tokens", "decode_tokens", "blocks_used", "blocks_free",
                                  "preemptions", "step_s"), rows)
    out.generation_steps = k


HEALTHY = Scenario()

#: one preset per problem, each differing from the healthy baseline in what shows it
SCENARIOS: dict[str, Scenario] = {
    "healthy": HEALTHY,
    "oom": HEALTHY.with_(name="oom", oom_events=2, memory_used_fraction=0.95),
    "repeated_oom": HEALTHY.with_(name="repeated_oom", oom_events=6, memory_used_fraction=0.95),
    "tail_latency": HEALTHY.with_(name="tail_latency", tail_fraction=0.03, tail_wait_s=0.25),
    "not_forming": HEALTHY.with_(name="not_forming", batch_size_mean=1.0, batch_size_sd=0.2,
                                 batches_per_s=30.0, utilization_pct=20.0,
                                 queue_depth_start=0.0, queue_depth_end=0.0),
    "wait_low_load": HEALTHY.with_(name="wait_low_load", batches_per_s=4.0, batch_size_mean=3.0,
                                   batch_size_sd=1.0, queue_wait_max_s=0.09,
                                   max_queue_delay_ms=50.0, utilization_pct=15.0,
                                   queue_depth_start=0.0, queue_depth_end=0.0),
    "saturation": HEALTHY.with_(name="saturation", batch_size_mean=32.0, batch_size_sd=0.5,
                                queue_depth_start=50, queue_depth_end=1000, rejected_per_s=5.0,
                                utilization_pct=97.0, queue_wait_max_s=0.5),
    "padding": HEALTHY.with_(name="padding", bucket_edges=(256,), length_max=256,
                             pad_to_bucket=True, model="encoder"),
    "diminishing": HEALTHY.with_(name="diminishing", max_batch_size=64, batch_size_mean=32.0,
                                 batch_size_sd=18.0, compute_base_s=0.001,
                                 compute_per_item_s=0.001),
    "low_util": HEALTHY.with_(name="low_util", utilization_pct=12.0, queue_depth_start=12,
                              queue_depth_end=12),
    "preemption": HEALTHY.with_(name="preemption", model="decoder", generation=True,
                                preemptions_per_step=0.8),
    "starvation": HEALTHY.with_(name="starvation", priority_extra_wait_s=(0.0, 0.002, 0.6),
                                priority_expired_fraction=(0.0, 0.0, 0.3)),
    "generation": HEALTHY.with_(name="generation", model="decoder", generation=True),
}


def fill(engine: Engine, names: Iterable[str], *, end_s: float, seed: int = 0,
         duration_s: float | None = None) -> dict[str, Generated]:
    """Write several presets (each under its own model name) into one database."""
    out = {}
    for i, name in enumerate(names):
        sc = SCENARIOS[name]
        if duration_s is not None:
            sc = sc.with_(duration_s=duration_s)
        out[name] = generate(engine, sc, end_s=end_s, seed=seed + i)
    return out
