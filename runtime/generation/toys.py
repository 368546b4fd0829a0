"""Generation models for tests and demos where the sequence of events must be steered.

``SteppedModel`` wraps a real ``GenerationModel`` and lets a caller hold steps at a
gate, wait until a number of steps ran, or make the next step raise. Nothing is
faked: every step that runs is the wrapped model's real step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from runtime.generation.model import GenerationModel
from runtime.generation.scheduler import ScheduledChunk


class SteppedModel(GenerationModel):
    kind = "generate"

    def __init__(self, inner: GenerationModel, *, gate_timeout_s: float = 30.0) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.vocab_size = inner.vocab_size
        self.max_model_len = inner.max_model_len
        self.tokenizer = inner.tokenizer
        self.supports_num_logits = inner.supports_num_logits  # type: ignore[misc]
        self.draft_model = inner.draft_model
        #: the inner model's LoRA targets (its ``adapter_bank`` is made in its ``setup``)
        self.adapter_targets = dict(getattr(inner, "adapter_targets", None) or {})
        self.max_adapter_rank = getattr(inner, "max_adapter_rank", 64)
        self.gate_timeout_s = gate_timeout_s
        self.steps_done = 0
        self.chunks_seen: list[list[ScheduledChunk]] = []
        self._open = threading.Event()
        self._open.set()
        self._progress = threading.Condition()
        self._fail_next: BaseException | None = None

    def setup(self, device: Any, num_blocks: int, block_size: int) -> None:
        self.inner.setup(device, num_blocks, block_size)
        self.device = self.inner.device

    @property
    def adapter_bank(self) -> Any:
        return getattr(self.inner, "adapter_bank", None)

    # -- steering -------------------------------------------------------------------
    def hold(self) -> None:
        """Steps that start from now on wait at the gate until ``release``."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def fail_next_step(self, error: BaseException) -> None:
        self._fail_next = error

    def wait_for_steps(self, count: int, timeout_s: float = 30.0) -> bool:
        """Block until at least ``count`` steps have completed; False on timeout."""
        with self._progress:
            return self._progress.wait_for(lambda: self.steps_done >= count, timeout=timeout_s)

    # -- the step -------------------------------------------------------------------
    def step(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        if not self._open.wait(self.gate_timeout_s):
            raise TimeoutError("the step gate stayed closed; call release()")
        self.chunks_seen.append(list(chunks))
        try:
            if self._fail_next is not None:
                error, self._fail_next = self._fail_next, None
                raise error
            return self.inner.step(chunks)
        finally:
            with self._progress:
                self.steps_done += 1
                self._progress.notify_all()
