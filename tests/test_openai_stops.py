"""Stop strings: the matcher on its own, then through a real generation engine."""

from __future__ import annotations

import asyncio
import random

import pytest

from batchscope.storage.records import ListRecorder, RequestRow
from runtime.api.errors import ClientError
from runtime.generation.config import GenerationConfig
from runtime.generation.engine import GenerationEngine
from runtime.generation.stops import StopMatcher
from runtime.models.decoder import TinyDecoder


def test_a_stop_string_split_across_pieces_is_found_and_held_back_meanwhile():
    m = StopMatcher(["\n\n", "END"])
    assert m.feed("Hello E") == ("Hello ", False)  # "E" may begin "END"
    assert m.feed("ND more") == ("", True)
    assert m.feed("anything") == ("", True) and m.stopped


def test_a_false_start_is_handed_on_with_the_next_piece():
    m = StopMatcher(["END"])
    assert m.feed("E") == ("", False)
    assert m.feed("x") == ("Ex", False)
    assert m.feed("EN") == ("", False)
    assert m.flush() == "EN" and m.flush() == ""


def test_the_earliest_stop_wins_and_overlapping_starts_are_kept():
    assert StopMatcher(["b", "abc"]).feed("xabcb") == ("x", True)
    m = StopMatcher(["aab"])
    assert m.feed("aa") == ("", False)
    assert m.feed("aab") == ("aa", True)  # "aaaab": the stop begins at the third "a"


def first_stop(text: str, stops: list[str], ends: list[int]) -> str | None:
    """The answer by brute force: at the first piece end where the text so far holds a
    stop string, the text before the earliest one found; None when none ever appears."""
    for end in ends:
        found = [k for k in (text[:end].find(s) for s in stops) if k >= 0]
        if found:
            return text[:min(found)]
    return None


def test_any_split_of_a_text_gives_the_text_before_the_first_stop_to_appear():
    rng = random.Random(7)
    alphabet = "ab\n"
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 4))]
        ends, end = [], 0
        while end < len(text):
            end = min(len(text), end + rng.randint(1, 4))
            ends.append(end)
        m = StopMatcher(stops)
        out, stopped, start = [], False, 0
        for end in ends:
            piece, stopped = m.feed(text[start:end])
            out.append(piece)
            start = end
            if stopped:
                break
        if not stopped:
            out.append(m.flush())
        expected = first_stop(text, stops, ends)
        assert "".join(out) == (text if expected is None else expected), (text, stops, ends)
        assert stopped == (expected is not None)


# -- through the engine --------------------------------------------------------------------
def run_engine(config: GenerationConfig, scenario):
    recorder = ListRecorder()
    engine = GenerationEngine(TinyDecoder(d_model=32, n_layers=1, max_model_len=128), config,
                              recorder=recorder)

    async def main():
        await engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.stop()

    return asyncio.run(main()), engine, recorder


async def text_of(engine, prompt: str, n: int, **kw) -> tuple[str, str | None]:
    events = [e async for e in engine.generate(prompt_text=prompt, max_new_tokens=n,
                                               ignore_eos=True, **kw)]
    return "".join(e.text for e in events), events[-1].finish_reason


CONFIG = dict(block_size=8, num_cache_blocks=64, max_model_len=128)


def test_the_engine_ends_a_request_at_its_stop_string_as_a_success():
    async def scenario(engine):
        full, reason = await text_of(engine, "abc", 30)
        stop = full[4:6]
        cut = await text_of(engine, "abc", 30, stop=[stop])
        return full, stop, reason, cut, engine.stats()

    (full, stop, reason, (text, cut_reason), stats), _, recorder = run_engine(
        GenerationConfig(**CONFIG), scenario)
    assert reason == "length" and cut_reason == "stop"
    assert text == full[:full.find(stop)]
    rows = recorder.of(RequestRow)
    assert [r.outcome for r in rows] == ["ok", "ok"]
    assert rows[0].output_tokens == 30 and 1 <= rows[1].output_tokens < 30
    assert stats["blocks_used"] == 0 and stats["running"] == 0


def test_in_static_mode_a_stopped_member_keeps_its_slot_until_the_batch_ends():
    async def scenario(engine):
        full, _ = await text_of(engine, "abc", 20)
        stop = full[2:4]
        both = await asyncio.gather(text_of(engine, "abc", 20, stop=[stop]),
                                    text_of(engine, "xyz", 20))
        return full, stop, both, engine.stats()

    (full, stop, both, stats), engine, _ = run_engine(
        GenerationConfig(mode="static", **CONFIG), scenario)
    (short, short_reason), (long, long_reason) = both
    assert short == full[:full.find(stop)] and short_reason == "stop"
    assert long_reason == "length"
    assert stats["padding_rows"] > 0  # the stopped member's row ran on as padding
    assert stats["blocks_used"] == 0


def test_stop_strings_need_a_list_of_strings_and_a_tokenizer():
    class NoText(TinyDecoder):
        name = "notext"

    model = NoText(d_model=32, n_layers=1, max_model_len=128)
    model.tokenizer = None
    engine = GenerationEngine(model, GenerationConfig(**CONFIG))

    async def main():
        await engine.start()
        try:
            with pytest.raises(ClientError, match="no tokenizer"):
                engine.submit([1, 2], stop=["x"])
            with pytest.raises(ClientError, match="list of strings"):
                engine.submit([1, 2], stop="x")
        finally:
            await engine.stop()

    asyncio.run(main())
