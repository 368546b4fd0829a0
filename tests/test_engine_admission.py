"""The shared admission checks: the request engine and the generation runner agree."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from runtime.api.config import BatchingConfig
from runtime.api.errors import ValidationError
from runtime.core.clock import FakeClock
from runtime.engine.admission import deadline_of, priority_of
from runtime.engine.engine import Engine
from runtime.generation.config import GenerationConfig
from runtime.generation.runner import StepRunner
from runtime.models.decoder import TinyDecoder
from runtime.models.toys import DoubleModel

BAD_TIMEOUTS = [math.inf, -math.inf, math.nan, 0, -5, True, "100"]
BAD_PRIORITIES = [-1, 3, 1.0, True, "1"]


def test_defaults_come_from_the_settings_and_the_deadline_from_now():
    cfg = BatchingConfig(default_priority=2, default_timeout_ms=250.0)
    assert priority_of(None, cfg) == 2 and priority_of(0, cfg) == 0
    assert deadline_of(None, cfg, 10.0) == pytest.approx(10.25)
    assert deadline_of(50, cfg, 10.0) == pytest.approx(10.05)
    assert deadline_of(None, BatchingConfig(), 10.0) is None
    assert deadline_of(None, GenerationConfig(default_timeout_ms=1000.0), 1.0) == 2.0


@pytest.mark.parametrize("timeout_ms", BAD_TIMEOUTS)
def test_both_engines_refuse_a_timeout_that_is_not_finite_and_positive(timeout_ms):
    with pytest.raises(ValidationError) as direct:
        deadline_of(timeout_ms, BatchingConfig(), 0.0)
    assert "must be a finite number of milliseconds above 0" in direct.value.message

    model = TinyDecoder(n_layers=1, max_model_len=64)
    runner = StepRunner(model, GenerationConfig(block_size=8, num_cache_blocks=16,
                                                max_model_len=64), clock=FakeClock())
    with pytest.raises(ValidationError) as generation:
        runner.new_sequence([1, 2], max_new_tokens=2, timeout_ms=timeout_ms)

    async def request() -> str:
        engine = Engine({"double": DoubleModel()})
        await engine.start()
        try:
            with pytest.raises(ValidationError) as info:
                await engine.infer("double", {"INPUT0": np.zeros(4, np.float32)},
                                   timeout_ms=timeout_ms)
            return info.value.message
        finally:
            await engine.stop()

    assert asyncio.run(request()) == generation.value.message == direct.value.message


@pytest.mark.parametrize("priority", BAD_PRIORITIES)
def test_a_priority_out_of_range_gets_the_same_message_from_both(priority):
    with pytest.raises(ValidationError, match=r"0 \(most urgent\) to 2") as batching:
        priority_of(priority, BatchingConfig())
    with pytest.raises(ValidationError) as generation:
        priority_of(priority, GenerationConfig())
    assert batching.value.message == generation.value.message
