"""The asyncio generation engine: streams, cancellation, timeouts, failures, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from batchscope.storage.records import GenStepRow, ListRecorder, RequestRow
from runtime.api.errors import ModelError, ModelNotReady, RequestExpired, ShuttingDown, ValidationError
from runtime.generation.config import GenerationConfig
from runtime.generation.engine import GenerationEngine
from runtime.generation.toys import SteppedModel
from runtime.models.decoder import TinyDecoder

pytestmark = pytest.mark.timeout(120)


def make_engine(recorder=None, **cfg) -> tuple[GenerationEngine, SteppedModel]:
    base = dict(block_size=8, num_cache_blocks=64, max_model_len=256)
    base.update(cfg)
    model = SteppedModel(TinyDecoder(n_layers=2, max_model_len=256))
    return GenerationEngine(model, GenerationConfig(**base), recorder=recorder), model


async def collect(engine: GenerationEngine, **kw) -> list:
    return [event async for event in engine.generate(**kw)]


async def wait_until(predicate, *, max_polls: int = 2000) -> None:
    for _ in range(max_polls):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


def test_concurrent_requests_share_steps_and_each_gets_its_tokens():
    async def main():
        rec = ListRecorder()
        engine, _ = make_engine(rec)
        await engine.start()
        results = await asyncio.gather(*[
            collect(engine, prompt_text=f"prompt {i}", max_new_tokens=5 + i, ignore_eos=True)
            for i in range(4)])
        await engine.stop()
        return engine, rec, results

    engine, rec, results = asyncio.run(main())
    for i, events in enumerate(results):
        assert [e.index for e in events] == list(range(5 + i))
        assert [e.finish_reason for e in events] == [None] * (4 + i) + ["length"]
    assert max(r.running for r in rec.of(GenStepRow)) > 1
    assert sorted(r.output_tokens for r in rec.of(RequestRow)) == [5, 6, 7, 8]
    assert engine.stats()["requests"]["ok"] == 4


def test_closing_a_stream_cancels_the_request_and_frees_its_blocks():
    async def main():
        rec = ListRecorder()
        engine, _ = make_engine(rec)
        await engine.start()
        agen = engine.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=200, ignore_eos=True)
        got = [await agen.__anext__() for _ in range(3)]
        await agen.aclose()
        stats = engine.stats()
        await engine.stop()
        return got, stats, rec

    got, stats, rec = asyncio.run(main())
    assert len(got) == 3
    assert stats["running"] == 0 and stats["blocks_used"] == 0
    assert [r.outcome for r in rec.of(RequestRow)] == ["cancelled"]


def test_waiting_request_expires_and_its_stream_raises():
    async def main():
        engine, model = make_engine(max_num_seqs=1)
        await engine.start()
        model.hold()
        first = engine.submit([1, 2], max_new_tokens=3, ignore_eos=True)
        late = engine.submit([3, 4], max_new_tokens=3, timeout_ms=1)
        # the late request's deadline passes while the held step keeps it waiting
        await asyncio.sleep(0.05)
        model.release()
        first_events = [e async for e in first]
        with pytest.raises(RequestExpired, match="timeout"):
            async for _ in late:
                pass
        await engine.stop()
        return first_events, engine.stats()

    first_events, stats = asyncio.run(main())
    assert len(first_events) == 3
    assert stats["requests"]["expired"] == 1 and stats["requests"]["ok"] == 1


def test_model_failure_reaches_only_the_requests_of_that_step():
    async def main():
        engine, model = make_engine(max_num_seqs=1)
        await engine.start()
        model.fail_next_step(RuntimeError("kernel exploded"))
        doomed = engine.submit([1, 2], max_new_tokens=3, ignore_eos=True)
        fine = engine.submit([3, 4], max_new_tokens=3, ignore_eos=True)
        with pytest.raises(ModelError, match="kernel exploded"):
            async for _ in doomed:
                pass
        events = [e async for e in fine]
        await engine.stop()
        return events, engine.stats()

    events, stats = asyncio.run(main())
    assert len(events) == 3
    assert stats["requests"]["error"] == 1 and stats["requests"]["ok"] == 1


def test_stop_drains_then_refuses_and_ends_leftovers_with_shutting_down():
    async def main():
        rec = ListRecorder()
        engine, model = make_engine(rec)
        with pytest.raises(ModelNotReady):
            engine.submit([1], max_new_tokens=1)
        await engine.start()
        quick = engine.submit([1, 2], max_new_tokens=2, ignore_eos=True)
        quick_events = [e async for e in quick]
        model.hold()
        stuck = engine.submit([5, 6], max_new_tokens=50, ignore_eos=True)
        stopping = asyncio.ensure_future(engine.stop(drain_timeout_s=0.05))
        await wait_until(lambda: not engine.is_ready())
        with pytest.raises(ShuttingDown):
            engine.submit([1], max_new_tokens=1)
        await stopping  # the held step keeps the stuck request from draining in time
        model.release()
        with pytest.raises(ShuttingDown):
            async for _ in stuck:
                pass
        return quick_events, rec

    quick_events, rec = asyncio.run(main())
    assert len(quick_events) == 2
    assert sorted(r.outcome for r in rec.of(RequestRow)) == ["cancelled", "ok"]


def test_settings_updates_notify_listeners_and_validate():
    async def main():
        engine, _ = make_engine()
        seen = []
        engine.on_settings_change.append(lambda name, version, cfg: seen.append((name, version, cfg.mode)))
        await engine.start()
        engine.update_settings({"mode": "static"}, requested_by="test")
        with pytest.raises(ValidationError):
            engine.update_settings({"block_size": 4})
        events = await collect(engine, prompt_token_ids=[1, 2], max_new_tokens=3, ignore_eos=True)
        await engine.stop()
        return seen, events, engine.get_settings()

    seen, events, (version, cfg) = asyncio.run(main())
    assert seen == [("decoder", 2, "static")]
    assert len(events) == 3 and version == 2 and cfg.mode == "static"
