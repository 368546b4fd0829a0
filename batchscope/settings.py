"""The settings schema shared by the runtime and the dashboard.

One ``Setting`` per field of the runtime's ``BatchingConfig`` (request/response models)
and ``GenerationConfig`` (generation models): its type, default, bounds, unit and a short
explanation. From this one table come

- the single-field checks of both config dataclasses (``Setting.problem``),
- the ``batchscope serve`` flags and their help texts (``Setting.parse_text``,
  ``Setting.describe``),
- the dashboard's settings form (``group``, bounds, ``choices``, ``doc``),
- the settings tables of ``docs/batching.md`` (``markdown_table``).

Rules that relate several fields (a floor below a ceiling, a default priority below the
number of levels, increasing bucket edges) are not here: they stay as code in the config
dataclasses. This module imports nothing from ``runtime``.

To add a setting: add the field to the dataclass, add its ``Setting`` here (the schema
test fails until both agree), and regenerate the tables of ``docs/batching.md`` with
``python -m batchscope.settings --write-docs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

Kind = Literal["int", "float", "bool", "choice", "int_list"]

#: words used for a unit inside a sentence ("a number of milliseconds from 0 to 60000")
_UNIT_WORDS = {"ms": "milliseconds", "s": "seconds"}
_NULL_WORDS = ("", "null", "none", "auto", "off")
_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")
#: words of a setting's name written as their usual spelling in its label, not just
#: capitalised ("oom_recovery" is "OOM recovery", not "Oom recovery")
ACRONYMS = {w.lower(): w for w in (
    "OOM", "CUDA", "SLO", "GPU", "CPU", "KV", "LoRA", "TTFT", "TPOT", "ID", "URL", "HTTP",
    "HTTPS", "gRPC", "MPS", "NVML", "NVTX", "OTLP", "API", "JSON", "CSV", "SQL", "MB",
    "GB", "GiB", "MiB", "RPS", "QPS", "VRAM", "DB")}
#: units written at the end of a setting's name (``_ms``), shown as "(ms)" in its label
_LABEL_UNITS = ("ms", "s", "mb")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _num(value: float) -> str:
    """``60000`` rather than ``60000.0``; other floats as Python writes them."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened so a huge value cannot flood an error message."""
    if isinstance(value, (list, tuple)) and len(value) > 20:
        return f"{repr(value[:20])[:limit - 20]}... ({len(value)} items)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Setting:
    """One setting: what it is, what values it takes and what it does."""

    name: str
    kind: Kind
    default: Any
    #: one or two sentences: what it does and when to change it
    doc: str
    #: "ms", "s", "requests", "MB", "batches", "tokens", "blocks", "levels", "edges" or None
    unit: str | None = None
    #: inclusive bounds (for ``int_list``: of each item); see ``min_exclusive``
    min: float | None = None
    max: float | None = None
    nullable: bool = False
    #: what null stands for, e.g. "work-conserving" or "no timeout"
    null_means: str | None = None
    choices: tuple[str, ...] = ()
    #: ``int_list`` only: how many items the list may hold
    max_items: int | None = None
    #: form section: "batching", "buckets", "queueing", "memory", "faults", "autopilot",
    #: "events", "generation", "cache", "speculation", "adapters"
    group: str = "batching"
    #: the lower bound itself is not allowed (a value must be above ``min``)
    min_exclusive: bool = False
    #: ``int_list`` only: the fewest items the list may hold
    min_items: int = 0
    #: sizes something allocated at start; a running runtime refuses to change it
    fixed_at_start: bool = False

    @property
    def label(self) -> str:
        """The name as a form shows it: ``max_queue_delay_ms`` -> "Max queue delay (ms)",
        ``oom_recovery`` -> "OOM recovery" (``ACRONYMS``), a unit at the end in brackets."""
        words = self.name.split("_")
        unit = ""
        if (self.unit is not None and self.unit.lower() in _LABEL_UNITS and len(words) > 1
                and words[-1] == self.unit.lower()):
            unit, words = f" ({self.unit})", words[:-1]
        words = [ACRONYMS.get(w, w) for w in words]
        words[0] = words[0][:1].upper() + words[0][1:]
        return " ".join(words) + unit

    # -- checking -----------------------------------------------------------------------
    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this setting, naming the field, the value and
        what would be valid; ``None`` when it is valid."""
        if value is None:
            return None if self.nullable else self._message(value)
        kind = self.kind
        if kind == "int":
            ok = _is_int(value) and self._in_range(value)
        elif kind == "float":
            ok = _is_number(value) and self._in_range(value)
        elif kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "choice":
            ok = isinstance(value, str) and value in self.choices
        else:  # int_list: the length first, so a huge list costs nothing more
            ok = (isinstance(value, tuple)
                  and self.min_items <= len(value) <= (self.max_items or len(value))
                  and all(_is_int(v) and self._in_range(v) for v in value))
        return None if ok else self._message(value)

    def _in_range(self, value: float) -> bool:
        if self.min is not None and (value <= self.min if self.min_exclusive else value < self.min):
            return False
        return self.max is None or value <= self.max

    def _range_words(self) -> str:
        """The bounds in words: "from 1 to 4096", "above 0 and at most 100", "above 0"..."""
        low, high = self.min, self.max
        if low is not None and high is not None:
            if self.min_exclusive:
                return f"above {_num(low)} and at most {_num(high)}"
            return f"from {_num(low)} to {_num(high)}"
        if low is not None:
            return f"above {_num(low)}" if self.min_exclusive else f"of at least {_num(low)}"
        if high is not None:
            return f"of at most {_num(high)}"
        return ""

    def _message(self, value: Any) -> str:
        head = f"{self.name}={_show(value)}"
        if self.kind == "bool":
            return f"{head} must be true or false"
        if self.kind == "choice":
            return f"{head} is not one of {', '.join(self.choices)}"
        span = self._range_words()
        if self.kind == "int":
            what = f"an integer {span}".rstrip()
        elif self.kind == "float":
            unit = _UNIT_WORDS.get(self.unit or "", self.unit)
            what = (f"a number of {unit} {span}" if unit else f"a number {span}").rstrip()
        else:
            count = (f"at most {self.max_items} " if self.max_items is not None else "")
            what = (f"a {'non-empty ' if self.min_items else ''}list of {count}integers "
                    f"{span}").rstrip()
        if self.nullable:
            means = f" ({self.null_means})" if self.null_means else ""
            return f"{head} must be null{means} or {what}"
        return f"{head} must be {what}"

    def coerce(self, value: Any) -> Any:
        """A JSON value in this setting's Python form: a list becomes a tuple for an
        ``int_list``, an integer becomes a float for a ``float``. Anything else is
        returned unchanged for ``problem`` to judge."""
        if self.kind == "int_list" and isinstance(value, list):
            return tuple(value)
        if self.kind == "float" and _is_int(value):
            return float(value)
        return value

    # -- text -----------------------------------------------------------------------------
    def parse_text(self, text: str) -> Any:
        """The value written in a CLI flag or a text box.

        ``""``, ``null``, ``none``, ``auto`` and ``off`` mean ``None`` for a nullable
        setting; an ``int_list`` is written ``16,32`` (or ``[16, 32]``; empty for an empty
        list). Raises ``ValueError`` saying what was expected. Bounds are not checked
        here: ``problem`` (and the config classes) do that.
        """
        raw = str(text).strip()
        if self.nullable and raw.lower() in _NULL_WORDS:
            return None
        kind = self.kind
        try:
            if kind == "int":
                return int(raw)
            if kind == "float":
                value = float(raw)
                if not math.isfinite(value):
                    raise ValueError
                return value
        except ValueError:
            raise ValueError(f"{self.name}: {raw!r} is not {self._article()}; "
                             f"write {self.describe()}") from None
        if kind == "bool":
            low = raw.lower()
            if low in _TRUE_WORDS:
                return True
            if low in _FALSE_WORDS:
                return False
            raise ValueError(f"{self.name}: {raw!r} is not true or false")
        if kind == "choice":
            if raw not in self.choices:
                raise ValueError(f"{self.name}: {raw!r} is not one of {', '.join(self.choices)}")
            return raw
        inner = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
        try:
            return tuple(int(item) for item in inner.split(",") if item.strip())
        except ValueError:
            raise ValueError(f"{self.name}: {_show(raw)} is not a comma-separated list of "
                             f"integers, e.g. 16,32,64") from None

    def to_text(self, value: Any) -> str:
        """``value`` written the way ``parse_text`` reads it back."""
        if value is None:
            return "null"
        if self.kind == "bool":
            return "true" if value else "false"
        if self.kind == "int_list":
            # "" reads back as null for a nullable list: its empty form is written []
            return ",".join(str(v) for v in value) if value or not self.nullable else "[]"
        if self.kind == "float":
            return _num(float(value))
        return str(value)

    def default_text(self) -> str:
        """The default as shown in help texts and the docs (``empty`` for an empty list)."""
        if self.kind == "int_list" and self.default == ():
            return "empty"
        return self.to_text(self.default)

    def _article(self) -> str:
        return {"int": "an integer", "float": "a number"}.get(self.kind, "valid")

    def describe(self) -> str:
        """The valid values in a few words, e.g. ``integer 1-4096 requests``."""
        unit = f" {self.unit}" if self.unit else ""
        low, high = self.min, self.max
        if low is not None and high is not None and not self.min_exclusive:
            span = f"{_num(low)}-{_num(high)}"
        else:
            span = self._range_words().replace("of ", "", 1)
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "choice":
            text = "one of " + ", ".join(self.choices)
        elif self.kind == "int_list":
            if self.max_items is None:
                count = "integers"
            elif self.min_items:
                count = f"{self.min_items}-{self.max_items} integers"
            else:
                count = f"up to {self.max_items} integers"
            text = f"list of {count} {span}{unit}".replace("  ", " ").rstrip()
        else:
            word = "integer" if self.kind == "int" else "number"
            text = f"{word} {span}{unit}".replace("  ", " ").rstrip()
        if self.nullable:
            text += f", or null ({self.null_means})" if self.null_means else ", or null"
        return text

    @property
    def flag(self) -> str:
        """The ``batchscope serve`` flag, e.g. ``--max-batch-size``."""
        return "--" + self.name.replace("_", "-")


# -- the settings ------------------------------------------------------------------------------
def _queueing(timeout_doc: str) -> tuple[Setting, ...]:
    """The queueing settings both kinds of model share."""
    return (
        Setting("max_queue_size", "int", 1024,
                "Backpressure: requests beyond this many waiting are refused with 429. Lower it "
                "to shed load sooner, raise it to absorb longer bursts.",
                unit="requests", min=1, max=1_000_000, group="queueing"),
        Setting("priority_levels", "int", 3,
                "How many priorities there are, from 0 (most urgent) to priority_levels - 1; "
                "a lower number runs first, ties by arrival.",
                unit="levels", min=1, max=16, group="queueing"),
        Setting("default_priority", "int", 1,
                "The priority of a request that gives none; must be below priority_levels.",
                min=0, max=15, group="queueing"),
        Setting("default_timeout_ms", "float", None, timeout_doc,
                unit="ms", min=0, max=3_600_000, min_exclusive=True, nullable=True,
                null_means="no timeout", group="queueing"),
    )


#: the LoRA adapter settings, shared by request models (a batch) and generation models
#: (a step's running sequences)
_ADAPTERS: tuple[Setting, ...] = (
    Setting("adapter_mixing", "bool", True,
            "For a model with LoRA adapters: one batch holds requests for different adapters "
            "(and the base), the base layers computed once and each row's adapter term added "
            "in the same forward. Off: a batch holds one adapter's requests only (per-adapter "
            "batching).",
            group="adapters"),
    Setting("max_adapters_per_batch", "int", 8,
            "The most distinct adapters one batch (a generation model: one step's running "
            "sequences) mixes; requests for further adapters wait for the next batch.",
            unit="adapters", min=1, max=1024, group="adapters"),
    Setting("adapter_slots", "int", 16,
            "Adapters kept on the device at once; a cold adapter takes the least recently used "
            "slot no running batch holds (an adapter_load event, with what it evicted).",
            unit="adapters", min=1, max=4096, group="adapters"),
    Setting("adapter_memory_mb", "float", 512.0,
            "The memory registered adapters may take together; loading one past it is "
            "refused with 507.",
            unit="MB", min=0, max=1_000_000, min_exclusive=True, group="adapters"),
)


BATCHING: tuple[Setting, ...] = (
    Setting("policy", "choice", "dynamic",
            "static waits for a full batch (bounded by static_max_wait_ms); dynamic dispatches "
            "at max_batch_size or when the oldest request has waited max_queue_delay_ms; "
            "adaptive sets that delay to adaptive_factor x the recent mean batch compute time, "
            "between adaptive_floor_ms and adaptive_ceiling_ms.",
            choices=("static", "dynamic", "adaptive")),
    Setting("max_batch_size", "int", 32,
            "The largest batch the model runs. Raise it for throughput while latency allows; "
            "OOM recovery may run below it for a while.",
            unit="requests", min=1, max=4096),
    Setting("max_queue_delay_ms", "float", None,
            "How long the oldest request waits for companions, even when the model is idle. "
            "Null is work-conserving: an idle model runs a request at once and batches form "
            "while it is busy.",
            unit="ms", min=0, max=60_000, nullable=True, null_means="work-conserving"),
    Setting("preferred_batch_sizes", "int_list", (),
            "Batch sizes the model runs best at; a partial batch is cut to the largest one "
            "that fits. Each must be at most max_batch_size.",
            unit="requests", min=1, max=4096, max_items=64),
    Setting("static_max_wait_ms", "float", 100.0,
            "static policy: the longest a partial batch waits before it runs anyway.",
            unit="ms", min=0, max=60_000),
    Setting("adaptive_floor_ms", "float", 1.0,
            "adaptive policy: the shortest batching delay; at most adaptive_ceiling_ms.",
            unit="ms", min=0, max=60_000),
    Setting("adaptive_factor", "float", 2.0,
            "adaptive policy: the delay as a multiple of the recent mean batch compute time.",
            min=0, max=100, min_exclusive=True),
    Setting("adaptive_ceiling_ms", "float", 200.0,
            "adaptive policy: the longest batching delay.",
            unit="ms", min=0, max=60_000),
    Setting("bucketing", "bool", True,
            "Length bucketing for variable-length inputs: one queue per bucket edge plus an "
            "overflow queue, so a batch holds requests of similar length.",
            group="buckets"),
    Setting("bucket_edges", "int_list", None,
            "The bucket edges in tokens, strictly increasing; a request longer than the last "
            "edge goes to the overflow bucket. Finer edges waste less padding. Null derives "
            "them from the lengths that arrive: auto_bucket_count edges with the least "
            "padding, refreshed as the lengths change (32,64,128,256 until 256 requests "
            "have arrived).",
            unit="tokens", min=1, max=1_000_000, min_items=1, max_items=64, nullable=True,
            null_means="derived from the observed lengths", group="buckets"),
    Setting("auto_bucket_count", "int", 8,
            "With bucket_edges null: how many edges are derived. More edges waste less "
            "padding but spread the requests over more queues, so each batch fills slower.",
            unit="edges", min=1, max=64, group="buckets"),
    Setting("max_batch_tokens", "int", None,
            "The most padded tokens (requests x padded length) one batch of a variable-length "
            "model may hold, as vLLM's max_num_batched_tokens: it bounds how long a batch "
            "holds the device, and so how long the other models sharing it wait behind it. A "
            "request longer than the limit runs alone. Ignored for fixed-shape models.",
            unit="tokens", min=1, max=10_000_000, nullable=True, null_means="no limit",
            group="buckets"),
    Setting("pad_to", "choice", "batch_max",
            "Pad a batch to the longest request in it (batch_max) or to its bucket's edge "
            "(bucket, fewer distinct shapes).",
            choices=("bucket", "batch_max"), group="buckets"),
    *_queueing("How long a request that gives no timeout may wait; one that waits longer is "
               "answered 503 and never runs."),
    Setting("allow_bypass", "bool", True,
            "Let requests marked real-time skip the batching window.",
            group="queueing"),
    Setting("oom_recovery", "bool", True,
            "On out-of-memory, split the failing batch, retry the halves and lower the "
            "effective max batch size.",
            group="memory"),
    Setting("oom_probe_after_batches", "int", 50,
            "After an OOM, clean batches in a row before the effective max batch size probes "
            "back up.",
            unit="batches", min=1, max=1_000_000, group="memory"),
    Setting("memory_budget_mb", "float", None,
            "A memory budget enforced on the CPU: a batch whose estimate is above it counts as "
            "an OOM.",
            unit="MB", min=0, min_exclusive=True, nullable=True, null_means="no budget",
            group="memory"),
    Setting("cuda_graphs", "bool", False,
            "Capture and replay CUDA graphs per batch size seen (GPU only; ignored on the CPU).",
            group="memory"),
    Setting("compile", "choice", "off",
            "Run the model's predict through torch.compile with this mode. It compiles when "
            "the setting takes effect, on synthetic batches before the next batch (a compile "
            "event records how long; models sharing its device thread wait meanwhile, those in "
            "device processes do not), then reuses its graphs for every batch size and length. reduce-overhead is torch's "
            "own CUDA graphs: cuda_graphs is ignored while compile is on.",
            choices=("off", "default", "reduce-overhead", "max-autotune"), group="memory"),
    Setting("isolate_errors", "bool", True,
            "When the model raises on a batch, split it in halves (recursively, like OOM "
            "recovery) so that only the requests it fails on alone get 500; gives up after "
            "3 x log2(batch size) splits, or when two requests fail alone before any retried "
            "part succeeds (a broken model).",
            group="faults"),
    Setting("execution_timeout_ms", "float", 30_000.0,
            "The longest one batch may run. Past it, its requests get 503 and the device "
            "process is restarted (with the device thread, the model refuses requests until "
            "the batch returns). Leave room for a first batch's warm-up.",
            unit="ms", min=0, max=3_600_000, min_exclusive=True, nullable=True,
            null_means="no execution timeout", group="faults"),
    Setting("execution_timeout_auto", "bool", True,
            "Once the model has run 5 batches, cut a batch at 10 x the 99th percentile of "
            "its recent batch times (at least 2 s) instead of waiting for "
            "execution_timeout_ms, which stays the ceiling: a hung model is cut in seconds.",
            group="faults"),
    *_ADAPTERS,
    Setting("autopilot_slo_p99_ms", "float", None,
            "Turns the autopilot on: window by window it moves max_batch_size, "
            "max_queue_delay_ms (dynamic policy) and, for a variable-length model whose "
            "batches are mostly padding, the bucket edges, to keep the p99 latency under this many "
            "milliseconds while serving as many requests as it can, and returns to the "
            "settings it started from when it cannot. Each move is a settings change "
            "requested by autopilot, with its reason in an autopilot event.",
            unit="ms", min=0, max=600_000, min_exclusive=True, nullable=True,
            null_means="autopilot off", group="autopilot"),
)

GENERATION: tuple[Setting, ...] = (
    Setting("mode", "choice", "continuous",
            "continuous: sequences join at the next step and leave as soon as they finish; "
            "static: a batch is admitted together and no one joins until all of it finished.",
            choices=("continuous", "static"), group="generation"),
    Setting("block_size", "int", 16,
            "Tokens per KV-cache block. Fixed once the cache is allocated.",
            unit="tokens", min=1, max=1024, group="cache", fixed_at_start=True),
    Setting("num_cache_blocks", "int", 512,
            "Blocks in the shared KV-cache pool, which holds block_size x num_cache_blocks "
            "tokens. Fixed once the cache is allocated.",
            unit="blocks", min=1, max=10_000_000, group="cache", fixed_at_start=True),
    Setting("max_model_len", "int", 1024,
            "The longest sequence (prompt + generated tokens) a request may reach; at most what "
            "the model attends over. Fixed once the cache is allocated.",
            unit="tokens", min=2, max=1_000_000, group="cache", fixed_at_start=True),
    Setting("max_num_seqs", "int", 32,
            "The most sequences running in one step.",
            unit="requests", min=1, max=4096, group="generation"),
    Setting("max_num_batched_tokens", "int", 512,
            "The most tokens (prefill chunks + decode tokens) computed in one step; at least "
            "max_num_seqs.",
            unit="tokens", min=1, max=1_000_000, group="generation"),
    Setting("long_prefill_token_threshold", "int", 0,
            "The most tokens of one prompt a single step computes, as vLLM's setting of the "
            "same name: a long prompt is prefilled in slices of this size, so the steps in "
            "between keep serving the running sequences' decodes. 0 caps nothing beyond "
            "max_num_batched_tokens.",
            unit="tokens", min=0, max=1_000_000, group="generation"),
    *_queueing("How long a request that gives no timeout may wait for its first step."),
    Setting("default_max_new_tokens", "int", 16,
            "max_tokens for a request that gives none.",
            unit="tokens", min=1, max=1_000_000, group="generation"),
    Setting("preemption_event_interval_s", "float", 1.0,
            "Preemptions are reported as events at most once per this many seconds, "
            "aggregated.",
            unit="s", min=0, max=3600, group="events"),
    Setting("speculative_method", "choice", "none",
            "Speculative decoding: none; ngram proposes the tokens that followed the latest "
            "occurrence of the sequence's last few tokens in its own prompt and output (no "
            "extra model); draft runs the model's small draft decoder. The model verifies the "
            "proposals in one forward; greedy output is token-identical to decoding without "
            "speculation and sampled output keeps its distribution.",
            choices=("none", "ngram", "draft"), group="speculation"),
    Setting("num_speculative_tokens", "int", 4,
            "Tokens proposed per sequence and step; each step then yields 1 to this + 1 "
            "tokens per sequence.",
            unit="tokens", min=1, max=16, group="speculation"),
    Setting("prompt_lookup_max", "int", 4,
            "ngram: the longest suffix of the sequence looked up in its earlier tokens.",
            unit="tokens", min=1, max=64, group="speculation"),
    Setting("prompt_lookup_min", "int", 1,
            "ngram: the shortest suffix looked up; at most prompt_lookup_max.",
            unit="tokens", min=1, max=64, group="speculation"),
    Setting("speculative_disable_by_batch_size", "int", None,
            "Speculation is off while more than this many sequences run, as vLLM's setting "
            "of the same name.",
            unit="requests", min=1, max=4096, nullable=True, null_means="no batch-size limit",
            group="speculation"),
    Setting("spec_auto_switch", "bool", True,
            "Measure the step time per generated token with and without speculation at each "
            "batch size and speculate only where it is cheaper; speculation that stopped "
            "paying is probed again every spec_probe_interval_steps steps. Each switch is a "
            "speculation event.",
            group="speculation"),
    Setting("spec_min_acceptance_rate", "float", 0.1,
            "With spec_auto_switch: speculation is off while fewer than this share of the "
            "proposed tokens are accepted (measured over the recent steps).",
            min=0, max=1, group="speculation"),
    Setting("spec_probe_interval_steps", "int", 256,
            "With spec_auto_switch: steps without speculation before it is measured again.",
            unit="steps", min=1, max=1_000_000, group="speculation"),
    *_ADAPTERS,
)

_KINDS: dict[str, tuple[Setting, ...]] = {"request": BATCHING, "generate": GENERATION}
_BY_NAME: dict[str, dict[str, Setting]] = {
    kind: {s.name: s for s in settings} for kind, settings in _KINDS.items()}


def fields_for(kind: str) -> tuple[Setting, ...]:
    """The settings of a model kind: ``"request"`` (BATCHING) or ``"generate"``
    (GENERATION)."""
    try:
        return _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown model kind {kind!r}; use 'request' or 'generate'") from None


def setting(kind: str, name: str) -> Setting | None:
    """The setting ``name`` of model kind ``kind``, or ``None`` when there is none."""
    fields_for(kind)
    return _BY_NAME[kind].get(name)


def markdown_table(kind: str) -> str:
    """The docs table of a model kind's settings (no trailing newline)."""
    rows = ["| setting | default | valid values | what it does |", "|---|---|---|---|"]
    for s in fields_for(kind):
        rows.append(f"| `{s.name}` | `{s.default_text()}` | {s.describe()} | {s.doc} |")
    return "\n".join(rows)


# -- docs upkeep -----------------------------------------------------------------------------
#: the guide that holds the generated tables, from the repository root
DOCS_PAGE = "docs/batching.md"


def table_markers(kind: str) -> tuple[str, str]:
    """The comments around the generated table of ``kind`` in ``DOCS_PAGE``."""
    return f"<!-- settings:{kind} -->", f"<!-- /settings:{kind} -->"


def with_tables(page: str) -> str:
    """``page`` with every marked settings table replaced by the generated one."""
    for kind in _KINDS:
        start, end = table_markers(kind)
        head, found, rest = page.partition(start)
        if not found:
            continue
        _, found_end, tail = rest.partition(end)
        if not found_end:
            raise ValueError(f"the page has {start} without {end}")
        page = f"{head}{start}\n{markdown_table(kind)}\n{end}{tail}"
    return page


def _main(argv: list[str]) -> int:
    import sys
    from pathlib import Path

    if argv[:1] == ["--write-docs"]:
        path = Path(argv[1] if len(argv) > 1 else DOCS_PAGE)
        path.write_text(with_tables(path.read_text()))
        print(f"settings tables written to {path}")
        return 0
    if argv[:1] and argv[0] in _KINDS:
        print(markdown_table(argv[0]))
        return 0
    print(f"usage: python -m batchscope.settings request|generate | --write-docs [{DOCS_PAGE}]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
