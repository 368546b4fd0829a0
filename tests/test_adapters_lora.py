"""LoRA adapters: PEFT's files read and checked against the base, and a mixed batch's rows
against PEFT's own forward of each row alone (the oracle)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from runtime.adapters.lora import (AdapterBank, AdapterRef, lora_term, random_pairs, read_peft,
                                   segment_add, segment_term, segments, stacked_term,
                                   write_peft)
from runtime.api.errors import ValidationError
from runtime.models.encoder import ADAPTER_TARGETS, EncoderModel, build_encoder, explicit_forward

peft = pytest.importorskip("peft")

#: ranks of the test adapters: mixed, one of them with a rank per module
RANKS = [4, 8, 16, 2, 8, 4, {m: (4 if m.endswith("linear1") else 12) for m in ADAPTER_TARGETS}, 6]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = []
    for i, rank in enumerate(RANKS):
        path = str(root / f"a{i}")
        write_peft(path, random_pairs(ADAPTER_TARGETS, rank, seed=100 + i, alpha=None),
                   base_model="encoder")
        dirs.append(path)
    return dirs


@pytest.fixture(scope="module")
def model() -> EncoderModel:
    m = EncoderModel()
    m.setup("cpu")
    return m


def _batch(model: EncoderModel, lengths: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    items = [torch.randint(1, 1000, (n,), generator=gen) for n in lengths]
    return items, model.collate(items, None)


def _peft_alone(path: str, ids: torch.Tensor) -> torch.Tensor:
    """PEFT's forward of one request with its adapter (module by module)."""
    net = copy.deepcopy(build_encoder())
    wrapped = peft.PeftModel.from_pretrained(net, path).eval()
    inner = wrapped.base_model.model
    mask = torch.zeros(1, ids.shape[0], dtype=torch.bool)
    with torch.inference_mode():
        return explicit_forward(inner, ids.unsqueeze(0), mask)[0]


def _base_alone(model: EncoderModel, ids: torch.Tensor) -> torch.Tensor:
    return model.predict(model.collate([ids], None))[0]


@pytest.mark.parametrize("count", [1, 2, 8])
def test_mixed_batch_rows_equal_peft_alone(model, adapter_dirs, count):
    bank: AdapterBank = model.adapter_bank
    refs = {slot: AdapterRef(f"a{slot}", adapter_dirs[slot], 1) for slot in range(count)}
    bank.prepare(refs)
    # every adapter twice, with base-only rows between them, lengths mixed (padding)
    rows = []
    for slot in range(count):
        rows += [slot, -1, slot]
    lengths = [5 + (7 * i) % 40 for i in range(len(rows))]
    items, batch = _batch(model, lengths, seed=count)
    with bank.activate(rows):
        out = model.predict(batch)
    assert not bank.active
    for i, slot in enumerate(rows):
        expected = _peft_alone(adapter_dirs[slot], items[i]) if slot >= 0 \
            else _base_alone(model, items[i])
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=0)
    # and each row alone through the bank equals PEFT too
    with bank.activate([0]):
        alone = model.predict(model.collate([items[0]], None))[0]
    torch.testing.assert_close(alone, _peft_alone(adapter_dirs[0], items[0]), atol=1e-5, rtol=0)


def test_adapter_changes_the_output(model, adapter_dirs):
    model.adapter_bank.prepare({0: AdapterRef("a0", adapter_dirs[0], 1)})
    items, batch = _batch(model, [12])
    with model.adapter_bank.activate([0]):
        with_adapter = model.predict(batch)[0]
    assert (with_adapter - _base_alone(model, items[0])).abs().max() > 1e-3


def test_formulations_agree():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, 16, generator=gen)
    a = torch.randn(4, 3, 16, generator=gen)
    b = torch.randn(4, 8, 3, generator=gen)
    rows = torch.tensor([0, 2, 2, 3, 1, 0])
    expected = lora_term(x, a, b, rows)
    torch.testing.assert_close(segment_term(x, a, b, rows), expected)
    torch.testing.assert_close(stacked_term(x, a, b, rows), expected)


def test_the_loop_reads_each_adapter_to_its_rank_and_skips_base_rows():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 16, generator=gen)
    a = torch.randn(4, 6, 16, generator=gen)
    b = torch.randn(4, 8, 6, generator=gen)
    a[1, 2:] = 0  # slot 1 holds a rank-2 adapter: zero past its rank
    b[1, :, 2:] = 0
    a[3], b[3] = 0, 0  # the zero slot of rows without an adapter
    slots = [1, 1, -1, 0, 2, 0, -1]
    groups = segments(slots)
    assert [(s, w) for s, w in groups if isinstance(w, slice)] == [(1, slice(0, 2)), (2, slice(4, 5))]
    assert [(s, w.tolist()) for s, w in groups if not isinstance(w, slice)] == [(0, [3, 5])]
    y = torch.randn(7, 8, generator=gen)
    expected = y + lora_term(x, a, b, torch.tensor([3 if s < 0 else s for s in slots]))
    torch.testing.assert_close(segment_add(y.clone(), x, a, b, groups, {0: 6, 1: 2, 2: 6}),
                               expected)


def test_read_peft_names_what_does_not_fit(tmp_path):
    small = {"encoder.layers.0.linear1": (256, 1024)}
    path = str(tmp_path / "wrong")
    pairs = random_pairs({"encoder.layers.0.linear1": (128, 1024),
                          "encoder.layers.0.nope": (4, 4)}, 8, seed=1)
    write_peft(path, pairs)
    with pytest.raises(ValidationError) as err:
        read_peft(path, small, "wrong")
    text = err.value.message
    assert "lora_A has shape [8, 128]" in text and "[8, 256]" in text
    assert "encoder.layers.0.nope" in text


def test_read_peft_refuses_rank_and_layout(tmp_path):
    path = str(tmp_path / "big")
    write_peft(path, random_pairs(ADAPTER_TARGETS, 80, seed=2))
    with pytest.raises(ValidationError, match="rank 80 is outside 1..64"):
        read_peft(path, ADAPTER_TARGETS, "big")
    with pytest.raises(ValidationError, match="no adapter_config.json"):
        read_peft(str(tmp_path), ADAPTER_TARGETS, "empty")
    config = json.load(open(os.path.join(path, "adapter_config.json")))
    config["use_dora"] = True
    json.dump(config, open(os.path.join(path, "adapter_config.json"), "w"))
    with pytest.raises(ValidationError, match="DoRA"):
        read_peft(path, ADAPTER_TARGETS, "big")


def test_bank_reloads_a_slot_only_for_another_adapter(adapter_dirs):
    bank = AdapterBank(ADAPTER_TARGETS)
    ref = AdapterRef("a1", adapter_dirs[1], 1)
    bank.prepare({3: ref})
    bank.prepare({3: ref})
    assert bank.loads == 1 and bank.holds(3) == ref
    bank.prepare({3: AdapterRef("a1", adapter_dirs[1], 2)})
    assert bank.loads == 2
