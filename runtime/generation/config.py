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

from runtime.api.config import _is_int, _is_number, apply_changes, check_queueing, collector
from runtime.api.errors import ConfigError

GenMode = Literal["continuous", "static"]
GEN_MODES: tuple[str, ...] = ("continuous", "static")

#: settings that size the KV cache; they cannot change while it is allocated
FIXED_AT_START: tuple[str, ...] = ("block_size", "num_cache_blocks", "max_model_len")


@dataclass(frozen=True)
class GenerationConfig:
    """How a generation model's sequences share the steps and the KV cache."""

    #: continuous: sequences join at the next step and leave as soon as they finish;
    #: static: a batch is admitted together and no one joins until all of it finished.
    mode: GenMode = "continuous"
    #: tokens per KV-cache block
    block_size: int = 16
    #: blocks in the shared pool; the cache holds ``block_size * num_cache_blocks`` tokens
    num_cache_blocks: int = 512
    #: the longest sequence (prompt + generated tokens) a request may reach
    max_model_len: int = 1024
    #: the most sequences running in one step
    max_num_seqs: int = 32
    #: the most tokens (prefill chunks + decode tokens) computed in one step
    max_num_batched_tokens: int = 512
    #: backpressure: requests beyond this many waiting are refused with 429
    max_queue_size: int = 1024
    #: priorities run from 0 (most urgent) to ``priority_levels - 1``
    priority_levels: int = 3
    default_priority: int = 1
    #: how long a request may wait for its first step when it gives no timeout; None = forever
    default_timeout_ms: float | None = None
    #: ``max_tokens`` when a request gives none
    default_max_new_tokens: int = 16
    #: preemptions are reported at most once per this many seconds (aggregated)
    preemption_event_interval_s: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        problems: list[str] = []
        need = collector(problems)

        def int_in(name: str, low: int, high: int) -> bool:
            value = getattr(self, name)
            ok = _is_int(value) and low <= value <= high
            need(ok, f"{name}={value!r} must be an integer from {low} to {high}")
            return ok

        need(self.mode in GEN_MODES, f"mode={self.mode!r} is not one of {', '.join(GEN_MODES)}")
        int_in("block_size", 1, 1024)
        int_in("num_cache_blocks", 1, 10_000_000)
        int_in("max_model_len", 2, 1_000_000)
        seqs_ok = int_in("max_num_seqs", 1, 4096)
        tokens_ok = int_in("max_num_batched_tokens", 1, 1_000_000)
        if seqs_ok and tokens_ok:
            need(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                 f"{self.max_num_seqs}: every running sequence needs at least one token per step; "
                 "raise max_num_batched_tokens or lower max_num_seqs")
        check_queueing(self, need)
        int_in("default_max_new_tokens", 1, 1_000_000)
        need(_is_number(self.preemption_event_interval_s)
             and 0 <= self.preemption_event_interval_s <= 3600,
             f"preemption_event_interval_s={self.preemption_event_interval_s!r} must be a number "
             "of seconds from 0 to 3600")
        if problems:
            raise ConfigError("invalid generation settings: " + "; ".join(problems)
                              + ". Nothing was changed.")

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
        return apply_changes(self, changes,
                             float_fields=("default_timeout_ms", "preemption_event_interval_s"))

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
