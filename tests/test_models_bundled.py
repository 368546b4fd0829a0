"""The bundled mlp and encoder models through their real hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.common import torch_threads
from runtime.api.errors import ClientError, ValidationError
from runtime.api.model import check_model
from runtime.models.encoder import D_MODEL, MAX_LENGTH, VOCAB_SIZE, EncoderModel
from runtime.models.mlp import MLPModel, build_mlp


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():  # the suite shares two cores: spinning intra-op threads slow everyone
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def mlp() -> MLPModel:
    m = MLPModel()
    m.setup("cpu")
    return m


@pytest.fixture(scope="module")
def encoder() -> EncoderModel:
    m = EncoderModel()
    m.setup("cpu")
    return m


def run(model, requests, pad_to=None):
    items = [model.decode(r) for r in requests]
    return model.split(model.predict(model.collate(items, pad_to)), len(items))


def test_models_pass_check_model(mlp, encoder):
    check_model(mlp)
    check_model(encoder)
    assert encoder.variable_length and encoder.max_length == MAX_LENGTH
    assert not mlp.variable_length


def test_mlp_weights_are_deterministic_and_not_trivial():
    a, b = build_mlp(), build_mlp()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    w = a[0].weight
    assert w.std().item() > 0.01
    assert a[0].bias.abs().sum().item() == 0.0


def test_mlp_batched_equals_one_by_one(mlp):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((5, 256)).astype(np.float32)
    batched = run(mlp, [{"INPUT0": x} for x in xs])
    assert len(batched) == 5
    for x, out in zip(xs, batched):
        single = run(mlp, [{"INPUT0": x}])[0]["OUTPUT0"]
        assert out["OUTPUT0"].shape == (10,) and out["OUTPUT0"].dtype == np.float32
        np.testing.assert_allclose(out["OUTPUT0"], single, rtol=1e-4, atol=1e-5)
    # the reference forward pass, written out
    net = mlp.net
    ref = torch.relu(torch.from_numpy(xs) @ net[0].weight.T + net[0].bias)
    ref = torch.relu(ref @ net[2].weight.T + net[2].bias) @ net[4].weight.T + net[4].bias
    np.testing.assert_allclose(np.stack([o["OUTPUT0"] for o in batched]), ref.detach().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_mlp_accepts_leading_batch_dim_of_one(mlp):
    x = np.ones((1, 256), np.float32)
    assert mlp.decode({"INPUT0": x}).shape == (256,)


@pytest.mark.parametrize("inputs, words", [
    ({}, "missing input 'INPUT0'"),
    ({"INPUT0": np.ones(255, np.float32)}, "[255]"),
    ({"INPUT0": np.ones((2, 256), np.float32)}, "[2, 256]"),
    ({"INPUT0": np.ones(256, np.float64)}, "float64"),
])
def test_mlp_decode_errors_name_input_and_expectation(mlp, inputs, words):
    with pytest.raises(ClientError) as err:
        mlp.decode(inputs)
    assert words in err.value.message and "FP32 [256]" in err.value.message


def test_encoder_padding_does_not_change_embeddings(encoder):
    rng = np.random.default_rng(1)
    reqs = [{"INPUT_IDS": rng.integers(1, VOCAB_SIZE, size=n)} for n in (8, 37, 128)]
    alone = [run(encoder, [r])[0]["EMBEDDING"] for r in reqs]
    together = run(encoder, reqs, pad_to=128)
    for a, t in zip(alone, together):
        assert t["EMBEDDING"].shape == (D_MODEL,)
        np.testing.assert_allclose(a, t["EMBEDDING"], rtol=1e-4, atol=1e-4)
    assert not np.allclose(alone[0], alone[1])


def test_encoder_length_and_collate(encoder):
    items = [encoder.decode({"INPUT_IDS": np.arange(1, n + 1)}) for n in (3, 5)]
    assert [encoder.length(i) for i in items] == [3, 5]
    batch = encoder.collate(items, 8)
    assert batch.ids.shape == (2, 8)
    assert batch.ids[0, 3:].eq(0).all()
    assert batch.pad_mask.tolist()[0] == [False] * 3 + [True] * 5
    assert encoder.collate(items, None).ids.shape == (2, 5)


@pytest.mark.parametrize("ids, exc, words", [
    (np.array([], np.int64), ValidationError, "0 tokens"),
    (np.ones(MAX_LENGTH + 1, np.int64), ValidationError, f"{MAX_LENGTH + 1} tokens"),
    (np.array([1, VOCAB_SIZE], np.int64), ValidationError, f"token id {VOCAB_SIZE}"),
    (np.array([1, -3], np.int64), ValidationError, "token id -3"),
    (np.array([1.0, 2.0]), ClientError, "float64"),
])
def test_encoder_decode_errors(encoder, ids, exc, words):
    with pytest.raises(exc) as err:
        encoder.decode({"INPUT_IDS": ids})
    assert words in err.value.message and "INPUT_IDS" in err.value.message


def test_encoder_accepts_int32_ids(encoder):
    item = encoder.decode({"INPUT_IDS": np.array([[5, 6, 7]], np.int32)})
    assert item.dtype == torch.int64 and item.tolist() == [5, 6, 7]


def test_estimate_batch_bytes_grows_with_batch_and_length(encoder, mlp):
    e = encoder.estimate_batch_bytes
    assert 0 < e(1, 32) < e(2, 32) < e(2, 64)
    assert e(4, 128) / e(4, 64) > 2.0   # attention is quadratic in length
    assert mlp.estimate_batch_bytes(8, 1) == 8 * mlp.estimate_batch_bytes(1, 1)


def test_wide_is_the_mlp_hooks_over_a_weight_bound_net():
    from runtime.models.loader import load_model
    from runtime.models.wide import HIDDEN, LAYERS, WideModel, build_wide

    wide = load_model("wide")
    assert isinstance(wide, WideModel) and wide.name == "wide"
    wide.setup("cpu")
    check_model(wide)
    weights = sum(p.numel() for p in wide.net.parameters()) * 4
    assert weights > 200e6 and LAYERS * HIDDEN * HIDDEN * 4 < weights  # every batch reads them
    with torch.no_grad():   # the seeded weights are the same on every build
        first = torch.cat([p.flatten()[:64] for p in build_wide().parameters()])
        again = torch.cat([p.flatten()[:64] for p in wide.net.parameters()])
        assert torch.equal(first, again) and float(first.abs().sum()) > 0
    rng = np.random.default_rng(5)
    requests = [{"INPUT0": rng.standard_normal(256).astype(np.float32)} for _ in range(3)]
    together = run(wide, requests)
    alone = [run(wide, [r])[0] for r in requests]
    for a, b in zip(together, alone):
        assert a["OUTPUT0"].shape == (10,)
        np.testing.assert_allclose(a["OUTPUT0"], b["OUTPUT0"], rtol=1e-4, atol=1e-5)
