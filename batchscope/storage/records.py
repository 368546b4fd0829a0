"""Plain record types handed to the recorder from the hot path.

They mirror the tables in ``batchscope.storage.schema`` (column name = field name) so the
background writer can insert them in bulk without translation. Building one is a
few attribute stores; nothing here touches the database.
"""

from __future__ import annotations

import json
import pickle
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat, starmap
from operator import itemgetter
from typing import Any, Callable, Optional, Protocol, Sequence


@dataclass(slots=True)
class BatchRow:
    instance_id: str
    model: str
    seq: int
    policy: str
    settings_version: int
    max_batch_size: int
    bucket: Optional[int]
    batch_size: int
    real_elements: int
    padded_elements: int
    queue_wait_min_s: float
    queue_wait_mean_s: float
    queue_wait_max_s: float
    compute_s: float
    started_at: float
    ended_at: float
    outcome: str = "ok"
    peak_memory_bytes: Optional[int] = None
    cuda_graph: bool = False
    queue_depth: Optional[int] = None
    peak_memory_increase_bytes: Optional[int] = None
    #: distinct LoRA adapters the batch mixed (0: base rows only; None: no adapters served)
    adapters: Optional[int] = None


@dataclass(slots=True)
class RequestRow:
    instance_id: str
    model: str
    batch_seq: Optional[int]
    priority: int
    arrived_at: float
    finished_at: float
    queue_wait_s: float
    latency_s: float
    outcome: str
    bypass: bool = False
    length: Optional[int] = None
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    prompt_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    #: JSON {input name: shape} (see ``shapes_json``) and the timeout it ran under, ms
    input_shape_json: Optional[str] = None
    timeout_ms: Optional[float] = None
    #: the LoRA adapter the request named (None: the base model)
    adapter: Optional[str] = None


#: ``((input name, shape), ...)``: a model's declared per-request input shapes, ``-1``
#: for the variable dimension
InputShapes = tuple


#: id(specs) -> (specs, their InputShapes): a model's specs are one long-lived object
_DECLARED: dict[int, tuple[Any, InputShapes]] = {}


def declared_shapes(specs: Any) -> InputShapes:
    """``InputShapes`` of a model's input specs (anything with ``name`` and ``shape``),
    worked out once per specs object (the engine asks once per batch)."""
    known = _DECLARED.get(id(specs))
    if known is not None and known[0] is specs:
        return known[1]
    shapes = tuple((str(s.name), tuple(int(d) for d in s.shape)) for s in specs)
    if len(_DECLARED) < 1024:
        _DECLARED[id(specs)] = (specs, shapes)
    return shapes


@lru_cache(maxsize=4096)
def shapes_json(shapes: InputShapes | None, length: Optional[int]) -> Optional[str]:
    """One request's input shapes as JSON, ``{"INPUT_IDS": [37], "MASK": [37]}``: the
    declared shapes with every variable dimension at ``length`` (kept ``-1`` when the
    length is unknown). None without declared shapes."""
    if not shapes:
        return None
    at = -1 if length is None else int(length)
    return json.dumps({name: [at if d == -1 else d for d in dims] for name, dims in shapes},
                      separators=(",", ":"))


def timeout_of(deadline_s: Optional[float], arrived_s: float) -> Optional[float]:
    """The timeout a request with this deadline ran under, ms (as the float difference of
    the two times: a reader rounds it, e.g. to the microsecond)."""
    return None if deadline_s is None else (deadline_s - arrived_s) * 1000.0


@dataclass(slots=True)
class RequestBatch:
    """The requests one batch answered, column by column: what the serving hot path
    hands over instead of one ``RequestRow`` per request (a few list appends per
    request instead of an object each). ``rows()`` gives the ``RequestRow``s, exactly
    as if they had been built one by one; a recorder that stores rows expands it off
    the hot path. Times are monotonic seconds; ``wall_offset_s`` turns them into wall
    time (``runtime.core.clock``'s fixed offset)."""

    instance_id: str
    model: str
    batch_seq: Optional[int]
    outcome: str
    started_s: float
    finished_s: float
    wall_offset_s: float
    priorities: list
    arrived_s: list
    bypass: list
    lengths: Optional[list] = None
    #: each request's deadline (monotonic seconds, None for none): its ``timeout_ms``
    deadlines_s: Optional[list] = None
    #: the model's declared input shapes (``declared_shapes``): each row's
    #: ``input_shape_json`` at its length
    input_shapes: Optional[InputShapes] = None
    #: each request's LoRA adapter (None: the base); None when no request named one
    adapters: Optional[list] = None

    def __len__(self) -> int:
        return len(self.arrived_s)

    def tuples(self) -> list[tuple]:
        """The rows as tuples in ``RequestRow`` field order."""
        off, started, finished = self.wall_offset_s, self.started_s, self.finished_s
        finished_at = finished + off
        inst, model, seq, outcome = self.instance_id, self.model, self.batch_seq, self.outcome
        lengths = self.lengths if self.lengths is not None else repeat(None)
        arrived, shapes, deadlines = self.arrived_s, self.input_shapes, self.deadlines_s
        if shapes is None:
            shaped: Any = repeat(None)
        elif self.lengths is None:
            shaped = repeat(shapes_json(shapes, None))
        else:  # one JSON text per distinct length
            by_length = {n: shapes_json(shapes, n) for n in set(self.lengths)}
            shaped = map(by_length.__getitem__, self.lengths)
        timeouts: Any = repeat(None) if deadlines is None else [
            None if d is None else (d - a) * 1000.0 for d, a in zip(deadlines, arrived)]
        adapters = self.adapters if self.adapters is not None else repeat(None)
        return [(inst, model, seq, p, a + off, finished_at, started - a, finished - a, outcome,
                 b, n, None, None, None, None, j, t, ad)
                for p, a, b, n, j, t, ad in zip(self.priorities, arrived, self.bypass, lengths,
                                                shaped, timeouts, adapters)]

    def rows(self) -> list[RequestRow]:
        return list(starmap(RequestRow, self.tuples()))


def expand(records: list) -> list:
    """``records`` with every ``RequestBatch`` and ``TraceBatch`` replaced by its rows, in
    order."""
    batched = BATCHED
    if not any(type(r) in batched for r in records):
        return records
    out: list = []
    for r in records:
        if type(r) in batched:
            out.extend(r.rows())
        else:
            out.append(r)
    return out


@dataclass(slots=True)
class EventRow:
    instance_id: str
    model: Optional[str]
    at: float
    kind: str
    message: str
    severity: str = "info"
    details_json: str = "{}"


@dataclass(slots=True)
class DeviceRow:
    instance_id: str
    at: float
    device: str
    kind: str
    utilization_pct: Optional[float] = None
    memory_used_bytes: Optional[int] = None
    memory_total_bytes: Optional[int] = None
    power_w: Optional[float] = None
    sm_clock_mhz: Optional[float] = None
    temperature_c: Optional[float] = None
    torch_allocated_bytes: Optional[int] = None
    torch_reserved_bytes: Optional[int] = None
    process_rss_bytes: Optional[int] = None


@dataclass(slots=True)
class GenStepRow:
    instance_id: str
    model: str
    at: float
    mode: str
    running: int
    waiting: int
    prefill_tokens: int
    decode_tokens: int
    blocks_used: int
    blocks_free: int
    preemptions: int
    step_s: float
    #: speculative decoding: tokens proposed (counted in decode_tokens too, as the model
    #: computed them) and how many of them were accepted; None: no speculation set up
    spec_draft_tokens: Optional[int] = None
    spec_accepted_tokens: Optional[int] = None
    #: sequences whose proposed tokens the step verified (None: no speculation set up)
    spec_sequences: Optional[int] = None
    #: distinct LoRA adapters among the step's sequences (0: base sequences only; None: the
    #: model takes no adapters)
    adapters: Optional[int] = None
    #: the step's number in its model's engine: the ``batch_seq`` of the requests first
    #: scheduled in it
    seq: Optional[int] = None


@dataclass(slots=True)
class TraceRow:
    """One traced request (``runtime.core.tracing``): Triton's timestamps as wall-clock
    seconds, None where the request did not get there or the server does not see it.
    ``recv_*``/``send_*`` are the transport's (``protocol`` http or grpc);
    ``trace_id`` numbers the traces of one instance from 1."""

    instance_id: str
    model: str
    trace_id: int
    protocol: str
    outcome: str
    request_start_at: float
    request_end_at: float
    #: the ``id`` the client sent with the request (KServe), if any
    request_id: Optional[str] = None
    batch_seq: Optional[int] = None
    recv_start_at: Optional[float] = None
    recv_end_at: Optional[float] = None
    queue_start_at: Optional[float] = None
    compute_start_at: Optional[float] = None
    compute_input_end_at: Optional[float] = None
    compute_output_start_at: Optional[float] = None
    compute_end_at: Optional[float] = None
    send_start_at: Optional[float] = None
    send_end_at: Optional[float] = None
    #: the W3C trace of the request's spans: the one its ``traceparent`` header named,
    #: or the one the server began for it when its spans are exported (then with no
    #: parent span); None for a request of neither
    w3c_trace_id: Optional[str] = None
    #: the caller's span, from the request's ``traceparent`` header, if it carried one
    w3c_parent_span_id: Optional[str] = None


#: what a ``TraceBatch`` holds of each trace, in order: its ids, then its timestamps
#: (monotonic seconds or None) in the order they happen
TRACE_FIELDS = ("trace_id", "model", "protocol", "outcome", "request_id", "batch_seq",
                "w3c_trace_id", "w3c_parent_span_id", "recv_start", "recv_end",
                "request_start", "queue_start", "compute_start", "compute_input_end",
                "compute_output_start", "compute_end", "request_end", "send_start",
                "send_end")


#: what a ``TraceBatch`` holds of each batch of plain traces, in order; the last value
#: lists the batch's traced members
PLAIN_BATCH_FIELDS = ("model", "protocol", "outcome", "batch_seq", "compute_start",
                      "compute_input_end", "compute_output_start", "compute_end",
                      "request_end", "members")
#: what it holds of each member of such a batch (times monotonic; ``span``: the ids of
#: its OpenTelemetry span as its answer's ``traceparent`` line where spans are exported,
#: else None, not a column). A member
#: may hold more values after these (the serving process's own, unread here: the
#: runtime hands the values of its plain traces over as they are)
PLAIN_MEMBER_FIELDS = ("trace_id", "request_id", "recv_start", "recv_end", "request_start",
                       "send_start", "send_end", "span")


def wall_times(times: Sequence[Optional[float]], offset_s: float) -> list[Optional[float]]:
    """A trace's monotonic ``times`` (None: not reached) as wall-clock seconds
    (``+ offset_s``), each made no earlier than the one before it (the items of one
    request may overlap)."""
    at: list[Optional[float]] = []
    last = None
    for t in times:
        if t is not None:
            if last is not None and t < last:
                t = last
            last = t
            at.append(t + offset_s)
        else:
            at.append(None)
    return at


#: a plain member's values up to its span (``PLAIN_MEMBER_FIELDS``)
_MEMBER_VALUES = itemgetter(*range(8))


@dataclass(slots=True)
class TraceBatch:
    """Traced requests handed over together, as ``RequestBatch`` does for requests: the
    serving thread keeps a finished trace with one list append and hands the list over
    every so often; the ``TraceRow``s are built off that thread (in the database
    writer's process where there is one). ``traces`` holds one tuple per trace in
    ``TRACE_FIELDS`` order, times monotonic; ``rows()`` turns each into wall-clock
    seconds (``wall_offset_s``), every timestamp made no earlier than the one before it
    (the items of one request may overlap), exactly as a ``TraceRow`` built at once.

    ``batches`` holds the plain traces of whole batches (one item each, no W3C parent):
    per batch one ``PLAIN_BATCH_FIELDS`` tuple whose last value lists its traced
    members, each a ``PLAIN_MEMBER_FIELDS`` sequence. What the members of a batch share
    (model, outcome, batch, compute and end times) is held once; a member's queue start
    is its request start (the engine queues a request as it takes it)."""

    instance_id: str
    wall_offset_s: float
    traces: list
    batches: list = field(default_factory=list)
    #: this record pickled (``packed``), once made
    _packed: Optional[bytes] = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.traces) + sum(len(b[-1]) for b in self.batches)

    def packed(self) -> bytes:
        """This record pickled, made once: a record handed to two processes (the database
        writer's and the span exporter's) is pickled once and copied as bytes by both.
        The tracer packs it as it hands it over (``Tracer.flush``), in a small piece while
        its traces are in the cache; else the first thread to send it does. Its lists must
        not change once it is handed over."""
        packed = self._packed
        if packed is None:
            with _PACKING:
                packed = self._packed
                if packed is None:
                    packed = self._packed = pickle.dumps(
                        (self.instance_id, self.wall_offset_s, self.traces, self.batches),
                        protocol=5)
        return packed

    def __reduce__(self) -> tuple:
        return _unpacked, (self.packed(),)

    def model_protocols(self) -> dict[tuple[str, str], int]:
        """(model, protocol) -> how many of its traces are of that model and protocol."""
        out: dict[tuple[str, str], int] = {}
        for t in self.traces:
            key = t[1], t[2]
            out[key] = out.get(key, 0) + 1
        for b in self.batches:
            key = b[0], b[1]
            out[key] = out.get(key, 0) + len(b[-1])
        return out

    def tuples(self) -> list[tuple]:
        """The rows as tuples in ``TraceRow`` field order."""
        inst, off = self.instance_id, self.wall_offset_s
        out = []
        for (trace_id, model, protocol, outcome, request_id, batch_seq, w3c_trace,
             w3c_parent, *times) in self.traces:
            at = wall_times(times, off)
            out.append((inst, model, trace_id, protocol, outcome, at[2], at[8], request_id,
                        batch_seq, at[0], at[1], at[3], at[4], at[5], at[6], at[7], at[9],
                        at[10], w3c_trace, w3c_parent))
        for (model, protocol, outcome, batch_seq, compute_start, input_end, output_start,
             compute_end, request_end, members) in self.batches:
            # the batch's own times, put in order once; a member whose times come in
            # order before and after them (the common case) needs nothing put in order
            shared = wall_times((compute_start, input_end, output_start, compute_end,
                                 request_end), 0.0)
            known = [t for t in shared if t is not None]
            first, last = (known[0], known[-1]) if known else (None, None)
            c0, c1, c2, c3, c4 = (None if t is None else t + off for t in shared)
            for trace_id, request_id, recv_start, recv_end, request_start, send_start, \
                    send_end, span in map(_MEMBER_VALUES, members):
                # its span's line names the trace the server began for it (no parent)
                w3c = None if span is None else span[16:48].decode()
                if recv_start is not None and recv_end is not None and send_start is not None \
                        and send_end is not None \
                        and recv_start <= recv_end <= request_start <= (
                            request_start if first is None else first) \
                        and (request_start if last is None else last) <= send_start <= send_end:
                    start = request_start + off
                    out.append((inst, model, trace_id, protocol, outcome, start, c4,
                                request_id, batch_seq, recv_start + off, recv_end + off, start,
                                c0, c1, c2, c3, send_start + off, send_end + off, w3c, None))
                    continue
                at = wall_times((recv_start, recv_end, request_start, request_start,
                                 compute_start, input_end, output_start, compute_end,
                                 request_end, send_start, send_end), off)
                out.append((inst, model, trace_id, protocol, outcome, at[2], at[8],
                            request_id, batch_seq, at[0], at[1], at[3], at[4], at[5], at[6],
                            at[7], at[9], at[10], w3c, None))
        return out

    def rows(self) -> list[TraceRow]:
        return list(starmap(TraceRow, self.tuples()))


def _unpacked(packed: bytes) -> TraceBatch:
    """The ``TraceBatch`` that ``TraceBatch.packed`` made ``packed`` of."""
    batch = TraceBatch(*pickle.loads(packed))
    batch._packed = packed
    return batch


#: held while a ``TraceBatch`` is pickled: the threads that may send one do so once
_PACKING = threading.Lock()

#: record types that stand for several rows of a table: their row type
BATCHED: dict[type, type] = {RequestBatch: RequestRow, TraceBatch: TraceRow}

Record = (BatchRow | RequestRow | RequestBatch | EventRow | DeviceRow | GenStepRow | TraceRow
          | TraceBatch)


class RecorderLike(Protocol):
    """What the runtime needs from a recorder: non-blocking ``put``. A recorder may also
    offer ``put_many(records)`` (a list, kept in order) for the rows of one batch;
    ``put_many_of`` falls back to ``put`` for those that do not. One that sets
    ``accepts_request_batches = True`` is handed ``RequestBatch`` and ``TraceBatch``
    records; others get their rows. One whose ``pickles_records`` is True sends them to
    another process: a ``TraceBatch`` comes packed already (``TraceBatch.packed``)."""

    def put(self, record: Record) -> None: ...

    @property
    def dropped(self) -> int: ...


def put_many_of(recorder: Any) -> Callable[[list], None]:
    """``recorder.put_many``, or a loop over ``recorder.put`` where it has none."""
    many = getattr(recorder, "put_many", None)
    if many is not None:
        return many
    put = recorder.put

    def put_each(records: list) -> None:
        for record in records:
            put(record)

    return put_each


@dataclass
class ListRecorder:
    """Keeps records in memory. For tests and for running with recording off."""

    records: list = field(default_factory=list)
    keep: bool = True

    #: takes ``RequestBatch`` and ``TraceBatch`` records (and keeps them as rows)
    accepts_request_batches = True

    def put(self, record: Record) -> None:
        if self.keep:
            if type(record) in BATCHED:
                self.records.extend(record.rows())
            else:
                self.records.append(record)

    def put_many(self, records: list) -> None:
        if self.keep:
            self.records.extend(expand(records))

    @property
    def dropped(self) -> int:
        return 0

    def of(self, kind: type) -> list:
        return [r for r in self.records if isinstance(r, kind)]
