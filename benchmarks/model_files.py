"""Model files to serve with ``--model hf:/onnx:/pt2:``, made here from nothing downloaded.

* ``export_onnx(name, path)`` / ``export_pt2(name, path)``: the bundled ``mlp`` or
  ``encoder`` network exported with a dynamic batch axis (and a dynamic length axis for
  the encoder), its inputs named as the builtin model names them (``INPUT0``;
  ``INPUT_IDS`` plus the padding mask ``pad_mask`` the server makes) and its output
  likewise, so a client cannot tell the file from the builtin;
* ``tiny_tokenizer(path)``: a byte-level BPE tokenizer trained in a second on a
  fixed text, saved with ``save_pretrained``;
* ``tiny_classifier(path)``, ``tiny_causal_lm(path, arch)``: randomly initialised
  (seeded) BERT classifier and GPT-2 / Llama decoders, saved with their tokenizer.

Run ``python -m benchmarks.model_files OUT_DIR`` to write them all to ``OUT_DIR``.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = ("The quick brown fox jumps over the lazy dog. Batching trades latency for "
          "throughput; a larger batch keeps the device busy while a request waits. ") * 8


def _quiet_export(fn):  # torch.onnx prints progress lines; keep benchmark output readable
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


def _builtin(name: str) -> tuple[torch.nn.Module, tuple, dict, list[str], list[str]]:
    batch = torch.export.Dim("batch", min=1, max=4096)
    if name == "mlp":
        from runtime.models.mlp import IN_FEATURES, build_mlp

        return (build_mlp(), (torch.zeros(2, IN_FEATURES),), {0: batch}, ["INPUT0"], ["OUTPUT0"])
    if name == "encoder":
        from runtime.models.encoder import MAX_LENGTH, build_encoder

        length = torch.export.Dim("length", min=1, max=MAX_LENGTH)
        ids = torch.randint(1, 1000, (2, 8))
        mask = torch.zeros(2, 8, dtype=torch.bool)
        return (build_encoder(), (ids, mask), ({0: batch, 1: length}, {0: batch, 1: length}),
                ["INPUT_IDS", "pad_mask"], ["EMBEDDING"])
    raise ValueError(f"no export of {name!r}: mlp or encoder")


def export_onnx(name: str, path: Path) -> Path:
    net, args, dims, inputs, outputs = _builtin(name)
    dynamic = dims if isinstance(dims, tuple) else (dims,)
    _quiet_export(lambda: torch.onnx.export(net, args, str(path), input_names=inputs,
                                            output_names=outputs, dynamic_shapes=dynamic,
                                            dynamo=True))
    return path


def export_pt2(name: str, path: Path, *, inferred_ranges: bool = False) -> Path:
    """``inferred_ranges``: mark the dynamic axes ``Dim.DYNAMIC`` and let torch work out
    their ranges, instead of the named ranges (some torch versions find a guard inside
    ``nn.TransformerEncoder`` that a named range violates; ``export_pt2`` then retries so)."""
    net, args, dims, inputs, _ = _builtin(name)
    if inferred_ranges:
        dims = tuple({axis: torch.export.Dim.DYNAMIC for axis in d} for d in dims) \
            if isinstance(dims, tuple) else {axis: torch.export.Dim.DYNAMIC for axis in dims}
    dynamic = dims if isinstance(dims, tuple) else (dims,)

    class Named(torch.nn.Module):  # forward's parameter names become the input names
        def __init__(self) -> None:
            super().__init__()
            self.net = net

    if name == "mlp":
        Named.forward = lambda self, INPUT0: {"OUTPUT0": self.net(INPUT0)}  # noqa: N803
    else:
        Named.forward = lambda self, INPUT_IDS, pad_mask: {"EMBEDDING": self.net(INPUT_IDS, pad_mask)}  # noqa: N803
    try:
        program = torch.export.export(Named().eval(), args, dynamic_shapes=dynamic)
    except Exception as exc:  # torch._dynamo.exc.UserError: "Constraints violated"
        if inferred_ranges or "onstraints violated" not in str(exc):
            raise
        return export_pt2(name, path, inferred_ranges=True)
    torch.export.save(program, str(path))
    return path


def tiny_tokenizer(path: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "[CLS]", "[SEP]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", cls_token="[CLS]", sep_token="[SEP]")
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return fast


def tiny_classifier(path: Path, labels: tuple[str, ...] = ("negative", "positive")) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    tok = tiny_tokenizer(path)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                        pad_token_id=tok.pad_token_id, num_labels=len(labels),
                        id2label=dict(enumerate(labels)), label2id={v: i for i, v in enumerate(labels)},
                        architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    BertForSequenceClassification(config).eval().save_pretrained(str(path))
    return path


def tiny_causal_lm(path: Path, arch: str = "gpt2") -> Path:
    import transformers as tf

    tok = tiny_tokenizer(path)
    common = {"vocab_size": len(tok), "bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id}
    if arch == "gpt2":
        config, cls = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common), \
            tf.GPT2LMHeadModel
    elif arch == "llama":  # grouped-query attention and rotary positions
        config, cls = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256, **common), tf.LlamaForCausalLM
    else:
        raise ValueError(f"no tiny {arch!r}: gpt2 or llama")
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(str(path))
    return path


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description="write model files to serve with hf:/onnx:/pt2:")
    parser.add_argument("out", type=Path, help="the folder to write them to")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    made = [export_onnx(n, out / f"{n}.onnx") for n in ("mlp", "encoder")]
    made += [export_pt2(n, out / f"{n}.pt2") for n in ("mlp", "encoder")]
    made += [tiny_classifier(out / "tiny-classifier")]
    made += [tiny_causal_lm(out / f"tiny-{arch}", arch) for arch in ("gpt2", "llama")]
    print("\n".join(map(str, made)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
