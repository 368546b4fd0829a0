"""Prometheus metrics fed from the same records the database gets.

``MetricsRecorder`` is recorder-like (``put(record)``): tee it with the database
recorder and the engine keeps one recording path. ``put`` only appends the record
to a pending list; the records are folded into the Prometheus series when the
list reaches ``FOLD_EVERY`` records or at scrape time, so the request path pays
one append. Queue depths and recorder drops are read at scrape time.
Everything lives in the recorder's own ``CollectorRegistry``.

Generation models get the series vLLM exports, named as vLLM names them with
``vllm:`` replaced by ``batchscope_`` and with vLLM's ``model_name`` label and
buckets, so a dashboard made for vLLM reads them once its prefix is changed:
``time_to_first_token_seconds``, ``time_per_output_token_seconds`` and
``e2e_request_latency_seconds`` (histograms, from the requests' records; a request's
time per output token is observed once per token after its first, so the sum and
count are exact), ``prompt_tokens_total``, ``generation_tokens_total`` and
``num_preemptions_total`` (counters), ``num_requests_running``,
``num_requests_waiting`` and ``kv_cache_usage_perc`` (gauges, 1 = every block in
use), the last four read from the generation engine's stats at scrape time. Also as
vLLM: ``iteration_tokens_total`` (histogram of the tokens computed per step, from the
step records), ``request_prefill_time_seconds`` (first step to first token),
``request_decode_time_seconds`` (first token to last) and ``inter_token_latency_seconds``
(a request's mean gap between tokens, observed once per token after its first), and,
read at scrape time, the speculative-decoding counters ``spec_decode_num_drafts``,
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos`` (label ``position``, from 0), with
``spec_decode_requests_without_proposer`` (requests that asked for speculation from a
model served without it).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchscope.storage.records import (BatchRow, GenStepRow, RequestBatch, RequestRow, TraceBatch,
                                        TraceRow)


CONTENT_TYPE = CONTENT_TYPE_LATEST

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: pending records folded into the series at this many (and at every scrape). Folding
#: costs the same per request from 64 records up (1.4 us here); more records kept pending
#: are only more objects alive for the garbage collector to traverse
FOLD_EVERY = 256
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0)


class _ScrapeCollector:
    """Gauges read when Prometheus scrapes: queue depth per model, recorder drops."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]],
                 dropped: Callable[[], int],
                 spans_dropped: Callable[[], int | None] = lambda: None) -> None:
        self._stats = stats
        self._dropped = dropped
        self._spans_dropped = spans_dropped

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        depth = GaugeMetricFamily("batchscope_queue_depth", "Requests waiting per model",
                                  labels=["model"])
        in_flight = GaugeMetricFamily("batchscope_in_flight_requests",
                                      "Requests in the batch running now", labels=["model"])
        eff = GaugeMetricFamily("batchscope_effective_max_batch_size",
                                "Max batch size after OOM backoff", labels=["model"])
        truncated = CounterMetricFamily("batchscope_truncated_inputs",
                                        "Inputs cut to the model's length limit (a text longer "
                                        "than its tokenizer's maximum)", labels=["model"])
        for model, st in self._stats().items():
            if st.get("truncated_inputs") is not None:
                truncated.add_metric([model], float(st["truncated_inputs"]))
            depth.add_metric([model], float(st.get("queue_depth", 0)))
            in_flight.add_metric([model], float(st.get("in_flight", 0)))
            if st.get("effective_max_batch_size") is not None:
                eff.add_metric([model], float(st["effective_max_batch_size"]))
        drops = CounterMetricFamily("batchscope_recorder_dropped_records",
                                    "Records the database recorder dropped since start (its "
                                    "buffer was full or the database refused them)")
        drops.add_metric([], float(self._dropped()))
        out = [depth, in_flight, eff, drops, truncated]
        spans = self._spans_dropped()
        if spans is not None:  # only while spans are exported (--otlp-traces-endpoint)
            lost = CounterMetricFamily("batchscope_trace_spans_dropped",
                                       "OpenTelemetry spans lost since start: turned "
                                       "away by a full export queue, in an export that "
                                       "failed, or unsent at stop")
            lost.add_metric([], float(spans))
            out.append(lost)
        return out


#: vLLM's buckets for the same series
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


#: (stats key, series name, help) of the speculative-decoding counters
_SPEC_COUNTERS = (
    ("num_drafts", "spec_decode_num_drafts", "Speculative decoding: verifications of "
                                             "proposed tokens"),
    ("num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens"),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Speculative decoding: proposed tokens accepted"),
    ("requests_without_proposer", "spec_decode_requests_without_proposer",
     "Requests that asked for speculative decoding from a model served without it (served "
     "without)"),
)


class _GenerationCollector:
    """vLLM's scrape-time series for the generation models among the stats: those whose
    stats describe a KV cache (``GenerationEngine.stats``)."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._stats = stats

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        def family(kind: Any, name: str, doc: str) -> Any:
            return kind(f"batchscope_{name}", doc, labels=["model_name"])

        running = family(GaugeMetricFamily, "num_requests_running",
                         "Generation requests in the running batch")
        waiting = family(GaugeMetricFamily, "num_requests_waiting",
                         "Generation requests waiting for a place in the running batch")
        usage = family(GaugeMetricFamily, "kv_cache_usage_perc",
                       "KV-cache blocks in use; 1 means every block")
        prompt = family(CounterMetricFamily, "prompt_tokens",
                        "Prompt tokens of the generation requests that were prefilled")
        generated = family(CounterMetricFamily, "generation_tokens", "Generated tokens")
        preemptions = family(CounterMetricFamily, "num_preemptions",
                             "Sequences preempted because the KV cache ran short")
        spec_counters = [(key, family(CounterMetricFamily, name, doc))
                         for key, name, doc in _SPEC_COUNTERS]
        per_pos = CounterMetricFamily("batchscope_spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: accepted tokens by their position "
                                      "among the proposed ones (0 first)",
                                      labels=["model_name", "position"])
        for model, st in self._stats().items():
            blocks = st.get("num_cache_blocks")
            if not blocks:
                continue
            running.add_metric([model], float(st.get("running", 0)))
            waiting.add_metric([model], float(st.get("waiting", 0)))
            usage.add_metric([model], float(st.get("blocks_used", 0)) / float(blocks))
            prompt.add_metric([model], float(st.get("prompt_tokens", 0)))
            generated.add_metric([model], float(st.get("tokens_generated", 0)))
            preemptions.add_metric([model], float(st.get("preemptions", 0)))
            spec = st.get("speculation")
            if spec:
                for key, counter in spec_counters:
                    counter.add_metric([model], float(spec[key]))
                for pos, n in enumerate(spec["accepted_per_pos"]):
                    per_pos.add_metric([model, str(pos)], float(n))
        return [running, waiting, usage, prompt, generated, preemptions,
                *(c for _, c in spec_counters), per_pos]


def _append(groups: dict[Any, list[float]], key: Any, value: float) -> None:
    values = groups.get(key)
    if values is None:
        groups[key] = [value]
    else:
        values.append(value)


def _observe_many(child: Any, values: list[float]) -> None:
    """``child.observe(v)`` for every value, with one increment per bucket and one for the
    sum (the histogram's own buckets are used when it exposes them)."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            child.observe(v)
        return
    per_bucket = [0] * len(bounds)
    for v in values:
        i = bisect_left(bounds, v)
        if i < len(per_bucket):
            per_bucket[i] += 1
    for i, n in enumerate(per_bucket):
        if n:
            buckets[i].inc(n)
    total.inc(math.fsum(values))


class _AdapterSlotCollector:
    """The LoRA slot cache's counters of the models that take adapters (``Engine.stats``'
    ``adapters``), read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._stats = stats

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        families = [(key, CounterMetricFamily(f"batchscope_adapter_{key}", doc, labels=["model"]))
                    for key, doc in (
                        ("slot_hits", "Adapters a batch found resident in their device slot"),
                        ("slot_misses", "Adapters a batch had to load into a device slot"),
                        ("slot_evictions", "Adapters taken out of their device slot (least "
                                           "recently used, or unloaded)"))]
        for model, st in self._stats().items():
            adapters = st.get("adapters")
            if not adapters:
                continue
            for key, family in families:
                family.add_metric([model], float(adapters.get(key, 0)))
        return [family for _, family in families]


class MetricsRecorder:
    """Turns BatchRow/RequestRow/TraceRow records (and the batched forms RequestBatch and
    TraceBatch) into Prometheus series; other records are ignored."""

    def __init__(self, *, stats: Callable[[], dict[str, dict[str, Any]]] | None = None,
                 dropped: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.batch_size = Histogram("batchscope_batch_size", "Requests per executed batch",
                                    ["model"], buckets=_BATCH_BUCKETS, registry=r)
        self.compute_seconds = Histogram("batchscope_batch_compute_seconds",
                                         "Time the model spent on one batch", ["model"],
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self.batches = Counter("batchscope_batches", "Executed batches", ["model", "outcome"],
                               registry=r)
        self.queue_wait_seconds = Histogram("batchscope_queue_wait_seconds",
                                            "Time a request waited before its batch ran",
                                            ["model"], buckets=_SECONDS_BUCKETS, registry=r)
        self.latency_seconds = Histogram("batchscope_request_latency_seconds",
                                         "Arrival to answer, per request; priority as "
                                         "clients send it (1 is the most urgent)",
                                         ["model", "outcome", "priority"],
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self.requests = Counter("batchscope_requests", "Finished requests by outcome",
                                ["model", "outcome"], registry=r)
        self.ttft_seconds = Histogram("batchscope_time_to_first_token_seconds",
                                      "Generation: arrival to first token", ["model_name"],
                                      buckets=_TTFT_BUCKETS, registry=r)
        self.tpot_seconds = Histogram("batchscope_time_per_output_token_seconds",
                                      "Generation: time per output token after the first",
                                      ["model_name"], buckets=_TPOT_BUCKETS, registry=r)
        self.traced = Counter("batchscope_traced_requests",
                              "Requests traced (Triton's trace extension: sampled by the trace "
                              "settings, or carrying a sampled W3C traceparent)",
                              ["model", "protocol"], registry=r)
        self.e2e_seconds = Histogram("batchscope_e2e_request_latency_seconds",
                                     "Generation: arrival to last token of finished requests",
                                     ["model_name"], buckets=_E2E_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("batchscope_iteration_tokens_total",
                                          "Generation: tokens computed per step (prefill "
                                          "chunks, decode and proposed tokens)",
                                          ["model_name"], buckets=_ITERATION_TOKEN_BUCKETS,
                                          registry=r)
        self.prefill_seconds = Histogram("batchscope_request_prefill_time_seconds",
                                         "Generation: first step to first token",
                                         ["model_name"], buckets=_TTFT_BUCKETS, registry=r)
        self.decode_seconds = Histogram("batchscope_request_decode_time_seconds",
                                        "Generation: first token to last", ["model_name"],
                                        buckets=_E2E_BUCKETS, registry=r)
        self.itl_seconds = Histogram("batchscope_inter_token_latency_seconds",
                                     "Generation: a request's mean time between tokens, once "
                                     "per token after its first", ["model_name"],
                                     buckets=_ITL_BUCKETS, registry=r)
        self.adapter_requests = Counter("batchscope_adapter_requests",
                                        "Finished requests of a model that takes LoRA adapters, "
                                        "by adapter (\"\" for the base model) and outcome",
                                        ["model", "adapter", "outcome"], registry=r)
        self.adapter_latency_seconds = Histogram("batchscope_adapter_request_latency_seconds",
                                                 "Arrival to answer of the answered requests of "
                                                 "a model that takes LoRA adapters, by adapter "
                                                 "(\"\" for the base model)",
                                                 ["model", "adapter"], buckets=_SECONDS_BUCKETS,
                                                 registry=r)
        r.register(_AdapterSlotCollector(lambda: self._stats()))
        #: model -> its registered adapters' names, for the models that take adapters: the
        #: ``adapter`` label takes only these (or "" for the base), so it stays bounded
        self._adapters: Callable[[], dict[str, list[str]]] = lambda: {}
        self._adapter_names: dict[str, frozenset] = {}
        self._adapter_children: dict[tuple[str, str, str], tuple] = {}
        self._adapters_read = False
        self._stats = stats or (lambda: {})
        self._dropped = dropped or (lambda: 0)
        self._spans_dropped: Callable[[], int | None] = lambda: None
        r.register(_ScrapeCollector(lambda: self._stats(), lambda: self._dropped(),
                                    lambda: self._spans_dropped()))
        r.register(_GenerationCollector(lambda: self._stats()))
        # labelled children cached: a dict lookup instead of prometheus' label resolution
        self._batch_children: dict[tuple[str, str], tuple] = {}
        self._request_children: dict[tuple[str, str, int], tuple] = {}
        self._pending: list[Any] = []

    def bind(self, *, stats: Callable[[], dict[str, dict[str, Any]]] | None = None,
             dropped: Callable[[], int] | None = None,
             spans_dropped: Callable[[], int] | None = None,
             adapters: Callable[[], dict[str, list[str]]] | None = None) -> None:
        """Attach the scrape-time sources once the engine and recorder exist
        (``adapters``: model -> registered adapter names, ``Engine.adapter_models``)."""
        if adapters is not None:
            self._adapters = adapters
        if stats is not None:
            self._stats = stats
        if dropped is not None:
            self._dropped = dropped
        if spans_dropped is not None:
            self._spans_dropped = spans_dropped

    # -- RecorderLike -------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        return 0

    accepts_request_batches = True

    def put(self, record: Any) -> None:
        pending = self._pending
        pending.append(record)
        if len(pending) >= FOLD_EVERY:
            self.fold()

    def put_many(self, records: list) -> None:
        pending = self._pending
        pending.extend(records)
        if len(pending) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Fold the pending records into the Prometheus series, grouped per series."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        observations: dict[Any, list[float]] = {}
        counts: dict[Any, int] = {}
        self._adapters_read = False
        for record in pending:
            kind = type(record)
            if kind is RequestRow:
                ch = self._request_child(record.model, record.outcome, record.priority)
                if record.outcome == "ok":
                    _append(observations, ch[0], record.queue_wait_s)
                _append(observations, ch[1], record.latency_s)
                counts[ch[2]] = counts.get(ch[2], 0) + 1
                label = self._adapter_label(record.model, record.adapter)
                if label is not None:
                    ach = self._adapter_child(record.model, label, record.outcome)
                    counts[ach[0]] = counts.get(ach[0], 0) + 1
                    if record.outcome == "ok":
                        _append(observations, ach[1], record.latency_s)
                if record.prompt_tokens is not None:  # a generation request
                    self._fold_generation(record, observations)
            elif kind is RequestBatch:
                self._fold_request_batch(record, observations, counts)
            elif kind is BatchRow:
                ch = self._batch_child(record)
                _append(observations, ch[0], record.batch_size)
                _append(observations, ch[1], record.compute_s)
                counts[ch[2]] = counts.get(ch[2], 0) + 1
            elif kind is GenStepRow:
                _append(observations, self.iteration_tokens.labels(record.model),
                        record.prefill_tokens + record.decode_tokens)
            elif kind is TraceBatch:
                for (model, protocol), n in record.model_protocols().items():
                    child = self.traced.labels(model, protocol)
                    counts[child] = counts.get(child, 0) + n
            elif kind is TraceRow:
                child = self.traced.labels(record.model, record.protocol)
                counts[child] = counts.get(child, 0) + 1
        for child, values in observations.items():
            _observe_many(child, values)
        for child, n in counts.items():
            child.inc(n)

    def _fold_generation(self, row: RequestRow, observations: dict) -> None:
        model = row.model
        if row.ttft_s is not None:
            _append(observations, self.ttft_seconds.labels(model), row.ttft_s)
        if row.tpot_s is not None and row.output_tokens and row.output_tokens > 1:
            gaps = [row.tpot_s] * (row.output_tokens - 1)
            observations.setdefault(self.tpot_seconds.labels(model), []).extend(gaps)
            observations.setdefault(self.itl_seconds.labels(model), []).extend(gaps)
        if row.outcome == "ok":
            _append(observations, self.e2e_seconds.labels(model), row.latency_s)
            if row.ttft_s is not None:
                _append(observations, self.prefill_seconds.labels(model),
                        max(0.0, row.ttft_s - row.queue_wait_s))
                _append(observations, self.decode_seconds.labels(model),
                        max(0.0, row.latency_s - row.ttft_s))

    def _batch_child(self, b: BatchRow) -> tuple:
        key = (b.model, b.outcome)
        ch = self._batch_children.get(key)
        if ch is None:
            ch = (self.batch_size.labels(b.model), self.compute_seconds.labels(b.model),
                  self.batches.labels(b.model, b.outcome))
            self._batch_children[key] = ch
        return ch

    def _adapter_label(self, model: str, adapter: str | None) -> str | None:
        """The ``adapter`` label of a request row: its adapter if registered, "" for the
        base; None: no adapter series (a model that takes none, an adapter gone)."""
        names = self._adapter_names.get(model)
        if (names is None or (adapter is not None and adapter not in names)) \
                and not self._adapters_read:
            self._read_adapters()
            names = self._adapter_names.get(model)
        if names is None:
            return None
        if adapter is None:
            return ""
        return adapter if adapter in names else None

    def _read_adapters(self) -> None:
        """Read the registered adapters again (at most once per fold)."""
        self._adapters_read = True
        try:
            self._adapter_names = {m: frozenset(n) for m, n in self._adapters().items()}
        except Exception:  # the engine is going away: keep what was known
            pass

    def _adapter_child(self, model: str, adapter: str, outcome: str) -> tuple:
        key = (model, adapter, outcome)
        ch = self._adapter_children.get(key)
        if ch is None:
            ch = (self.adapter_requests.labels(model, adapter, outcome),
                  self.adapter_latency_seconds.labels(model, adapter))
            self._adapter_children[key] = ch
        return ch

    def _prune_adapters(self) -> None:
        """Drop the series of adapters no longer registered, so the label's values stay
        those of the registered adapters."""
        self._read_adapters()
        names = self._adapter_names
        for key in list(self._adapter_children):
            model, adapter, outcome = key
            known = names.get(model)
            if known is not None and (adapter == "" or adapter in known):
                continue
            del self._adapter_children[key]
            try:
                self.adapter_requests.remove(model, adapter, outcome)
            except KeyError:
                pass
            if not any(k[:2] == (model, adapter) for k in self._adapter_children):
                try:
                    self.adapter_latency_seconds.remove(model, adapter)
                except KeyError:
                    pass

    def _fold_request_batch(self, b: RequestBatch, observations: dict, counts: dict) -> None:
        started, finished, ok = b.started_s, b.finished_s, b.outcome == "ok"
        if b.adapters is not None or self._adapter_label(b.model, None) is not None:
            self._fold_adapters(b, observations, counts)
        levels = set(b.priorities)
        if len(levels) == 1:  # the common case: one child for the whole batch
            ch = self._request_child(b.model, b.outcome, b.priorities[0])
            if ok:
                observations.setdefault(ch[0], []).extend([started - a for a in b.arrived_s])
            observations.setdefault(ch[1], []).extend([finished - a for a in b.arrived_s])
            counts[ch[2]] = counts.get(ch[2], 0) + len(b.arrived_s)
            return
        for p, a in zip(b.priorities, b.arrived_s):
            ch = self._request_child(b.model, b.outcome, p)
            if ok:
                _append(observations, ch[0], started - a)
            _append(observations, ch[1], finished - a)
            counts[ch[2]] = counts.get(ch[2], 0) + 1

    def _fold_adapters(self, b: RequestBatch, observations: dict, counts: dict) -> None:
        """The adapter series of a block of requests of a model that takes adapters."""
        finished, ok = b.finished_s, b.outcome == "ok"
        names = b.adapters if b.adapters is not None else [None] * len(b.arrived_s)
        for adapter, a in zip(names, b.arrived_s):
            label = self._adapter_label(b.model, adapter)
            if label is None:
                continue
            ch = self._adapter_child(b.model, label, b.outcome)
            counts[ch[0]] = counts.get(ch[0], 0) + 1
            if ok:
                _append(observations, ch[1], finished - a)

    def _request_child(self, model: str, outcome: str, priority: int) -> tuple:
        key = (model, outcome, priority)
        ch = self._request_children.get(key)
        if ch is None:
            ch = (self.queue_wait_seconds.labels(model),
                  # the engine counts priorities from 0, clients from 1 (KServe, OpenAI)
                  self.latency_seconds.labels(model, outcome, str(priority + 1)),
                  self.requests.labels(model, outcome))
            self._request_children[key] = ch
        return ch

    # -- exposition ---------------------------------------------------------------------
    def render(self) -> bytes:
        self.fold()
        if self._adapter_children:
            self._prune_adapters()
        return generate_latest(self.registry)
