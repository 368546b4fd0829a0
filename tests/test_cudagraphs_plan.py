"""CUDA-graph bookkeeping (size selection, capture book, batch flattening) on the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from runtime.device.cudagraphs import (CAPTURE, EAGER, REPLAY, CudaGraphRunner, GraphBook,
                                default_capture_sizes, flatten, pad_rows, select_size, shape_key)
from runtime.models.encoder import EncoderModel
from runtime.models.mlp import MLPModel


def test_default_capture_sizes():
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(8) == (1, 2, 4, 8)
    assert default_capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    with pytest.raises(ValueError):
        default_capture_sizes(0)


@pytest.mark.parametrize("n, sizes, want", [
    (1, (1, 2, 4), 1), (3, (1, 2, 4), 4), (4, (4, 1, 2), 4), (5, (8, 16, 6), 6), (33, (1, 32, 64), 64),
])
def test_select_size_picks_smallest_that_fits(n, sizes, want):
    assert select_size(n, sizes) == want


def test_select_size_rejects_impossible():
    with pytest.raises(ValueError, match="larger than every capture size"):
        select_size(9, (1, 2, 8))
    with pytest.raises(ValueError):
        select_size(0, (1, 2))


def test_graph_book_remembers_captures_and_failures():
    book = GraphBook(max_graphs=2, max_failures=2)
    assert book.decide("a") == CAPTURE
    book.captured("a")
    assert book.decide("a") == REPLAY
    book.failed("b", "sync in forward")
    assert book.decide("b") == EAGER and book.decide("c") == CAPTURE
    assert book.disabled_reason is None
    book.captured("c")
    assert book.decide("d") == CAPTURE          # max_graphs reached: capturing evicts the oldest
    assert book.captured("d") == ["a"] and book.decide("a") == CAPTURE
    book.failed("e", "again")
    assert "2 shapes" in book.disabled_reason and "again" in book.disabled_reason
    assert book.decide("c") == REPLAY          # captured graphs keep working
    assert book.decide("a") == EAGER           # nothing new is captured


@dataclass
class Pair:
    ids: torch.Tensor
    mask: torch.Tensor
    note: str = "kept"


def test_flatten_round_trips_structures():
    a, b = torch.zeros(2, 3), torch.ones(2, 5)
    for batch in (a, (a, b), [a, {"m": b}], {"x": a, "y": (b, 7)}, Pair(a, b)):
        leaves, rebuild = flatten(batch)
        assert all(isinstance(t, torch.Tensor) for t in leaves) and len(leaves) in (1, 2)
        doubled = rebuild([t + 1 for t in leaves])
        again, _ = flatten(doubled)
        assert [torch.equal(x + 1, y) for x, y in zip(leaves, again)] == [True] * len(leaves)
    rebuilt = flatten(Pair(a, b))[1]([a, a])
    assert isinstance(rebuilt, Pair) and rebuilt.note == "kept" and rebuilt.mask.shape == (2, 3)
    assert flatten({"y": (b, 7)})[1]([a])["y"][1] == 7


def test_pad_rows_repeats_first_row_and_shape_key():
    t = torch.arange(6).reshape(3, 2)
    p = pad_rows(t, 5)
    assert p.tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [0, 1]]
    assert pad_rows(t, 3) is t
    assert shape_key([t, torch.zeros(3, 7, dtype=torch.bool)], 3) == (((2,), "torch.int64"), ((7,), "torch.bool"))
    assert shape_key([t, torch.zeros(2, 7)], 3) is None   # rows disagree: cannot pad
    assert shape_key([], 3) is None


def test_runner_is_a_pass_through_on_cpu():
    model = MLPModel()
    model.setup("cpu")
    runner = CudaGraphRunner(model, "cpu", max_batch_size=8)
    assert not runner.active and "not a CUDA device" in runner.stats()["disabled_reason"]
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    batch = model.collate(list(x), None)
    out, as_graph = runner.run(batch, 3)
    assert as_graph is False
    assert torch.equal(out, model.predict(batch))
    assert runner.stats()["eager_runs"] == 1 and runner.stats()["graphs"] == 0


def test_runner_plan_keys_on_padded_size_and_bucket_length():
    model = EncoderModel()
    runner = CudaGraphRunner(model, "cpu", capture_sizes=(1, 4, 8), max_batch_size=8)
    runner.active = True          # exercise the planning that a CUDA device would use
    runner.book = GraphBook()
    ids = [torch.arange(1, 6)] * 3
    model.device = torch.device("cpu")
    b3 = model.collate(ids, 16)
    decision, key, size = runner.plan(b3, 3)
    assert (decision, size) == (CAPTURE, 4)
    runner.book.captured(key)
    assert runner.plan(model.collate(ids[:2] + ids[:2], 16), 4)[0] == REPLAY   # same size and bucket
    assert runner.plan(model.collate(ids, 32), 3)[0] == CAPTURE                 # another bucket length
    assert runner.plan(model.collate(ids * 3, 16), 9) == (EAGER, None, 9)       # beyond the largest size
