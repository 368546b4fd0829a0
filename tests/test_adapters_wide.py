"""LoRA adapters on the weight-bound ``wide`` model: the demo adapters fit its linear
layers, and a mixed batch's rows equal PEFT's own forward of each row alone (the oracle)."""

from __future__ import annotations

import copy
from typing import Iterator

import pytest
import torch

from benchmarks.common import torch_threads
from runtime.adapters.demo import write_demo_adapters
from runtime.adapters.lora import AdapterRef, read_peft
from runtime.models.wide import ADAPTER_TARGETS, WideModel

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, str]:
    return write_demo_adapters(str(tmp_path_factory.mktemp("wide-adapters")), 8, "wide")


@pytest.fixture(scope="module")
def model() -> Iterator[WideModel]:
    with torch_threads(1):  # the suite shares two cores: spinning intra-op threads slow everyone
        wide = WideModel()
        wide.setup("cpu")
        yield wide


@pytest.fixture(scope="module")
def oracle(model, adapter_dirs):
    """PEFT's wrapping of a copy of the base net, every demo adapter loaded."""
    names = list(adapter_dirs)
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(model.net), adapter_dirs[names[0]],
                                             adapter_name=names[0])
    for name in names[1:]:
        wrapped.load_adapter(adapter_dirs[name], adapter_name=name)
    return wrapped.eval()


def _peft_alone(oracle, name: str, x: torch.Tensor) -> torch.Tensor:
    oracle.set_adapter(name)
    with torch.inference_mode():
        return oracle.base_model.model(x.unsqueeze(0))[0]


def test_demo_adapters_fit_every_linear_layer(adapter_dirs):
    for name, path in adapter_dirs.items():
        adapter = read_peft(path, ADAPTER_TARGETS, name)
        assert set(adapter.pairs) == set(ADAPTER_TARGETS) == {"0", "2", "4", "6", "8"}


@pytest.mark.parametrize("count", [1, 8])
def test_mixed_batch_rows_equal_peft_alone(model, adapter_dirs, oracle, count):
    names = list(adapter_dirs)[:count]
    bank = model.adapter_bank
    bank.prepare({slot: AdapterRef(name, adapter_dirs[name], 1) for slot, name in enumerate(names)})
    rows = []
    for slot in range(count):
        rows += [slot, -1, slot]
    x = torch.randn(len(rows), 256, generator=torch.Generator().manual_seed(count))
    base = model.predict(x)
    with bank.activate(rows):
        out = model.predict(x)
    assert not bank.active
    for i, slot in enumerate(rows):
        if slot < 0:
            torch.testing.assert_close(out[i], base[i], atol=1e-5, rtol=0)
            continue
        expected = _peft_alone(oracle, names[slot], x[i])
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=0)
        assert (out[i] - base[i]).abs().max() > 1e-3  # the adapter changes the output
