"""``GenerationConfig``: the settings of one generation model's scheduler.

Like ``BatchingConfig`` it is frozen and validated; ``with_changes`` returns a new
validated config or raises ``ConfigError`` and changes nothing. The scheduler reads
it once per step, so a change takes effect at the next step. The cache geometry
(``block_size``, ``num_cache_blocks``, ``max_model_len``) is fixed once the cache
is allocated; changing it at run time is refused with a message saying so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Literal

from batchscope.settings import GENERATION
from runtime.api.config import apply_changes, field_problems
from runtime.api.errors import ConfigError

GenMode = Literal["continuous", "static"]
GEN_MODES: tuple[str, ...] = next(s.choices for s in GENERATION if s.name == "mode")
SpecMethod = Literal["none", "ngram", "draft"]
SPEC_METHODS: tuple[str, ...] = next(s.choices for s in GENERATION
                                     if s.name == "speculative_method")

#: settings that size the KV cache; they cannot change while it is allocated
FIXED_AT_START: tuple[str, ...] = tuple(s.name for s in GENERATION if s.fixed_at_start)


@dataclass(frozen=True)
class GenerationConfig:
    """How a generation model's sequences share the steps and the KV cache.

    What each field means, its unit and its valid values are in
    ``batchscope.settings.GENERATION`` (also the table in docs/batching.md); the defaults
    here must equal the schema's, which a test checks.
    """

    mode: GenMode = "continuous"
    block_size: int = 16
    num_cache_blocks: int = 512
    max_model_len: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    #: tokens of one prompt a single step computes at most; 0 = only the step budget caps it
    long_prefill_token_threshold: int = 0
    max_queue_size: int = 1024
    priority_levels: int = 3
    default_priority: int = 1
    default_timeout_ms: float | None = None  # None: no timeout
    default_max_new_tokens: int = 16
    preemption_event_interval_s: float = 1.0
    # -- speculative decoding (continuous mode only) --
    speculative_method: SpecMethod = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    speculative_disable_by_batch_size: int | None = None  # None: no batch-size limit
    spec_auto_switch: bool = True
    spec_min_acceptance_rate: float = 0.1
    spec_probe_interval_steps: int = 256
    # -- LoRA adapters (a model that declares adapter targets) --
    adapter_mixing: bool = True
    max_adapters_per_batch: int = 8
    adapter_slots: int = 16
    adapter_memory_mb: float = 512.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` listing every problem. Each field's own type, bounds and
        message come from ``batchscope.settings.GENERATION``; the rules between fields are
        here."""
        bad = field_problems(self, GENERATION)
        problems = list(bad.values())
        if not {"max_num_seqs", "max_num_batched_tokens"} & bad.keys() \
                and self.max_num_batched_tokens < self.max_num_seqs:
            problems.append(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                f"{self.max_num_seqs}: every running sequence needs at least one token per step; "
                "raise max_num_batched_tokens or lower max_num_seqs")
        if not {"prompt_lookup_min", "prompt_lookup_max"} & bad.keys() \
                and self.prompt_lookup_min > self.prompt_lookup_max:
            problems.append(
                f"prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max="
                f"{self.prompt_lookup_max}; the shortest suffix looked up cannot be longer "
                "than the longest")
        if not {"max_adapters_per_batch", "adapter_slots"} & bad.keys() \
                and self.max_adapters_per_batch > self.adapter_slots:
            problems.append(f"max_adapters_per_batch={self.max_adapters_per_batch} exceeds "
                            f"adapter_slots={self.adapter_slots}: a step's adapters must all be "
                            "on the device; raise adapter_slots or lower max_adapters_per_batch")
        if problems:
            raise ConfigError("invalid generation settings: " + "; ".join(problems)
                              + ". Nothing was changed.")

    @property
    def speculating(self) -> bool:
        """Whether steps may carry proposed tokens (a method chosen, continuous mode)."""
        return self.speculative_method != "none" and self.mode == "continuous"

    @property
    def cache_tokens(self) -> int:
        """How many tokens the whole KV cache holds."""
        return self.block_size * self.num_cache_blocks

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_changes(self, changes: dict[str, Any]) -> "GenerationConfig":
        """A new validated config with ``changes`` applied; raises ConfigError."""
        return apply_changes(self, changes, GENERATION)

    def with_runtime_changes(self, changes: dict[str, Any]) -> "GenerationConfig":
        """Like ``with_changes`` but refuses the settings that size the allocated cache."""
        if isinstance(changes, dict):
            fixed = sorted(k for k in changes if k in FIXED_AT_START
                           and changes[k] != getattr(self, k))
            if fixed:
                raise ConfigError(f"{fixed} size the KV cache, which is allocated when the model "
                                  "starts; restart the runtime with the new value to change them. "
                                  "Nothing was changed.")
        return self.with_changes(changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GenerationConfig":
        return cls().with_changes(data)

    @classmethod
    def for_model(cls, model_max_len: int | None,
                  changes: dict[str, Any] | None = None) -> "GenerationConfig":
        """The defaults for a model that attends over ``model_max_len`` tokens (0/None =
        unknown): ``max_model_len`` capped at it, then ``changes`` applied. Raises
        ConfigError when the result asks for more than the model attends over."""
        base = cls(max_model_len=min(1024, model_max_len or 1024))
        config = base.with_changes(changes) if changes else base
        if model_max_len and config.max_model_len > model_max_len:
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds what the model can "
                              f"attend over ({model_max_len}); lower max_model_len to at most "
                              f"{model_max_len}. Nothing was changed.")
        return config
