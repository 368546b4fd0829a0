"""The API a decoder model implements to be served with continuous batching.

One call per step computes every scheduled chunk together::

    setup(device, num_blocks, block_size)   allocate weights and the paged KV pool
    step(chunks) -> logits                  [len(chunks), vocab_size] float tensor: the
                                            next-token logits after each chunk's last token

Each ``ScheduledChunk`` carries the token ids to compute, the position of the first
one and the sequence's block table: token position ``p`` writes its keys/values to
block ``block_table[p // block_size]``, slot ``p % block_size``, and attends to all
positions ``<= p`` of the same sequence. A chunk may be a whole prompt, part of one
(chunked prefill), a recomputation after preemption, or one decode token; the model
need not know which. ``step`` runs off the event loop under ``torch.inference_mode()``.

Speculative decoding needs the logits after several tokens of one chunk: a chunk
with ``num_logits = n`` asks for one row per each of its last ``n`` tokens, so ``step``
returns ``sum(c.num_logits for c in chunks)`` rows, in chunk order. A model that does
this sets ``supports_num_logits = True``; for one that does not, the runner computes a
chunk with proposed tokens as single-token chunks of the same sequence in the same
step, which is right for a model that writes every chunk's keys/values before any
chunk attends (as the bundled decoder does).

Text goes through a ``Tokenizer`` (``encode``/``decode``); the bundled one is
byte-level. Chat messages become a prompt through ``chat_template``
(``runtime.generation.chat``; ``ROLE_TAGS`` unless the model gives its own, None
for no chat). Sampling is greedy at temperature 0, otherwise seeded per request.
"""

from __future__ import annotations

import codecs
from typing import Any, ClassVar, Protocol, Sequence as Seq

import torch

from runtime.generation.chat import ROLE_TAGS, ChatTemplate
from runtime.generation.scheduler import ScheduledChunk


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decoder(self) -> "IncrementalDecoder": ...


class IncrementalDecoder(Protocol):
    def feed(self, token_id: int) -> str:
        """The text that ``token_id`` completes (may be empty mid-character)."""

    def flush(self) -> str: ...


class ByteTokenizer:
    """Ids 0-255 are the UTF-8 bytes of the text; ``eos_token_id`` is 256.

    Ids above 256 (a vocabulary may be larger) are reserved and decode to nothing.
    """

    eos_token_id: int | None = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self) -> "ByteDecoder":
        return ByteDecoder()

    def decode(self, token_ids: Seq[int]) -> str:
        dec = self.decoder()
        return "".join(dec.feed(t) for t in token_ids) + dec.flush()


class ByteDecoder:
    """Turns a stream of byte tokens into text deltas, holding back split characters."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._utf8.decode(bytes((token_id,)))
        return ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class GenerationModel:
    """Base class for a model served by ``GenerationEngine``."""

    #: the name clients use as ``model`` in ``/v1/completions``
    name: ClassVar[str] = ""
    kind: ClassVar[str] = "generate"
    vocab_size: int = 0
    #: the longest sequence the model can attend over (its position limit)
    max_model_len: int = 0
    tokenizer: Any = None
    #: how /v1/chat/completions turns messages into a prompt text; None = no chat
    #: (a model without a tokenizer has none either way)
    chat_template: ChatTemplate | None = ROLE_TAGS
    device: Any = None
    #: the settings to serve this model with when the engine is given none
    #: (``batchscope serve --model-config/--set`` put them here); None = defaults
    generation_config: Any = None
    #: ``step`` honours ``ScheduledChunk.num_logits`` (see the module's docstring)
    supports_num_logits: ClassVar[bool] = False
    #: the small model that proposes tokens with ``speculative_method="draft"``: a
    #: ``GenerationModel`` with the same vocabulary; None = the bundled one where it fits
    draft_model: Any = None

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    def setup(self, device: Any, num_blocks: int, block_size: int) -> None:
        """Load weights and allocate a KV pool of ``num_blocks`` blocks of ``block_size`` tokens."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement setup(device, num_blocks, block_size): "
            "load the weights and allocate the paged KV pool")

    def step(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk; return ``[len(chunks), vocab_size]`` next-token logits."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement step(chunks) -> logits [len(chunks), vocab]")

    def kv_bytes_per_block(self) -> int | None:
        """Memory of one KV block, for reports. None = unknown."""
        return None

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "vocab_size": self.vocab_size,
                "max_model_len": self.max_model_len, "eos_token_id": self.eos_token_id}


def make_sampler_state(temperature: float, seed: int | None) -> torch.Generator | None:
    """Per-request sampling state: None for greedy, else a generator seeded once."""
    if temperature <= 0:
        return None
    gen = torch.Generator()
    gen.manual_seed(int(seed or 0))
    return gen


def sample(logits: torch.Tensor, rows: list[tuple[int, float, torch.Generator | None]]
           ) -> list[int]:
    """Next tokens for the given ``(row, temperature, generator)`` of ``logits``.

    Greedy rows are decided with one argmax over all of them; seeded rows draw from
    ``softmax(logits / temperature)`` with their own generator, so a request's
    tokens do not depend on which other requests shared its steps.
    """
    tokens: list[int] = [0] * len(rows)
    logits = logits.float().cpu()
    greedy = [i for i, (_, temp, _) in enumerate(rows) if temp <= 0]
    if greedy:
        picks = logits[[rows[i][0] for i in greedy]].argmax(dim=-1).tolist()
        for i, tok in zip(greedy, picks):
            tokens[i] = int(tok)
    for i, (row, temp, gen) in enumerate(rows):
        if temp > 0:
            x = logits[row].double()
            # shifted first, in float64 (which holds any temperature a request may send): a
            # tiny temperature then gives -inf and 0, not inf - inf (nan)
            probs = torch.softmax((x - x.max()) / temp, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
