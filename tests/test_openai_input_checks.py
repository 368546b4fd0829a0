"""Bad input to the OpenAI-style routes (``/v1/...``) of a real server on 127.0.0.1: a
compressed body is inflated or refused by its ``Content-Encoding``, a field of the wrong
JSON type is refused naming it (a boolean is no number and a number no boolean), and an
error names the input or field at fault in OpenAI's ``param``.

One server, as ``batchscope serve --model decoder --model encoder`` makes it: the
generation model ``decoder`` and the embedding model ``encoder``.
"""

from __future__ import annotations

import asyncio
import gzip
import secrets
import tracemalloc
import zlib

import httpx
import orjson
import pytest

from runtime.api.config import ServerConfig
from runtime.models.decoder import TinyDecoder
from runtime.models.encoder import EncoderModel
from runtime.server import fastpath, openai_http
from runtime.server.bounds import MAX_JSON_BYTES
from runtime.server.openai_http import COMPRESSED_ASIDE_BYTES, PLAIN_ASIDE_BYTES
from runtime.server.service import Service, ServiceThread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = {"model": "decoder", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": "decoder", "prompt": "hi", "max_tokens": 1}
EMBEDDING = {"model": "encoder", "input": ["ab", "cd"]}

#: (route, a body it answers 200)
ROUTES = [pytest.param("/v1/embeddings", EMBEDDING, id="embeddings"),
          pytest.param("/v1/completions", COMPLETION, id="completions"),
          pytest.param("/v1/chat/completions", CHAT, id="chat")]


@pytest.fixture(scope="module")
def http():
    service = Service({"encoder": EncoderModel()}, None, ServerConfig(record=False),
                      generation={"decoder": TinyDecoder(d_model=32, n_layers=1)},
                      instance_id="openai-input-checks")
    with ServiceThread(service) as runner, httpx.Client(base_url=runner.url, timeout=60) as c:
        yield c


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of ``response``, which must have ``status``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


def post(http: httpx.Client, route: str, body: bytes, coding: str | None = None
         ) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if coding is not None:
        headers["content-encoding"] = coding
    return http.post(route, content=body, headers=headers)


# -- Content-Encoding ----------------------------------------------------------------------
@pytest.mark.parametrize("route, body", ROUTES)
def test_a_gzip_or_deflate_body_is_inflated_and_answered_as_the_plain_one(http, route, body):
    raw = orjson.dumps(body)
    plain = post(http, route, raw)
    assert plain.status_code == 200, plain.text
    for coding, packed in (("gzip", gzip.compress(raw)), ("x-gzip", gzip.compress(raw)),
                           ("deflate", zlib.compress(raw)),  # zlib-wrapped, as RFC 9110 says
                           ("deflate", zlib.compress(raw)[2:-4]),  # raw deflate, as some send
                           ("identity", raw), ("gzip, identity", gzip.compress(raw))):
        r = post(http, route, packed, coding)
        assert r.status_code == 200, (coding, r.text)
        assert r.json()["object"] == plain.json()["object"]
    if route == "/v1/embeddings":  # the same vectors, whatever carried them
        assert r.json()["data"] == plain.json()["data"]


@pytest.mark.parametrize("route, body", ROUTES)
@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, br"])
def test_another_coding_is_415_naming_the_codings_taken(http, route, body, coding):
    # the body is plain JSON: labelled compressed, it must not be read as it is
    error = error_of(post(http, route, orjson.dumps(body), coding), 415)
    assert "Content-Encoding" in error["message"] and "gzip or deflate" in error["message"]
    assert error["code"] == "unsupported_encoding"


@pytest.mark.parametrize("route, body", ROUTES)
def test_every_content_encoding_line_is_undone(http, route, body):
    raw = gzip.compress(orjson.dumps(body))
    two = [("content-type", "application/json"), ("content-encoding", "identity"),
           ("content-encoding", "gzip")]
    assert http.post(route, content=raw, headers=two).status_code == 200
    error = error_of(http.post(route, content=raw, headers=[two[0], ("content-encoding", "gzip"),
                                                            ("content-encoding", "br")]), 415)
    assert "'br'" in error["message"]


@pytest.mark.parametrize("route, body", ROUTES)
def test_a_body_inflating_past_the_json_limit_is_413(http, route, body):
    bomb = gzip.compress(b'{"model": "x", "input": "' + b" " * (MAX_JSON_BYTES + 1) + b'"}')
    assert len(bomb) < 64 * 1024
    error = error_of(post(http, route, bomb, "gzip"), 413)
    assert "inflates to more than" in error["message"] and str(MAX_JSON_BYTES) in error["message"]


@pytest.mark.parametrize("route, body", ROUTES)
def test_a_body_that_is_not_what_its_coding_says_is_400(http, route, body):
    raw = orjson.dumps(body)
    error = error_of(post(http, route, raw, "gzip"), 400)
    assert "not valid gzip data" in error["message"]
    error = error_of(post(http, route, gzip.compress(raw)[:-8], "gzip"), 400)
    assert "ends before its compressed stream does" in error["message"]


# -- large compressed bodies: inflated and parsed off the event loop -----------------------
@pytest.fixture
def inflations(monkeypatch):
    """Where the OpenAI routes inflate each compressed body, in order: True on an event
    loop, False on a worker thread. The real ``decoded_body`` does the inflating."""
    return where_called(monkeypatch, "decoded_body")


def where_called(monkeypatch, name: str) -> list[bool]:
    """Where ``runtime.server.openai_http.NAME`` is called, in order: True on an event
    loop, False on a worker thread; the real function does the work."""
    seen: list[bool] = []
    real = getattr(openai_http, name)

    def watched(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        return real(*args, **kwargs)

    monkeypatch.setattr(openai_http, name, watched)
    return seen


def gzip_bomb(claimed: int) -> bytes:
    """A gzip body of one JSON object of ``claimed`` bytes, compressed a MiB at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    spaces = b" " * (1 << 20)
    parts = [packer.compress(b'{"model": "x", "input": "')]
    parts += [packer.compress(spaces) for _ in range(claimed >> 20)]
    parts.append(packer.compress(b'"}') + packer.flush())
    return b"".join(parts)


@pytest.mark.parametrize("route, body", ROUTES)
def test_a_large_compressed_body_is_inflated_on_a_worker_thread_and_answered_alike(
        http, route, body, inflations):
    assert COMPRESSED_ASIDE_BYTES == fastpath.LARGE_COMPRESSED_BYTES  # as KServe bodies are
    small = gzip.compress(orjson.dumps(body))
    # a field the routes ignore, of random hex: it compresses to about half its length
    large = gzip.compress(orjson.dumps({**body, "padding": secrets.token_hex(32 * 1024)}))
    assert len(small) <= COMPRESSED_ASIDE_BYTES < len(large)
    plain = post(http, route, orjson.dumps(body))
    answers = [post(http, route, small, "gzip"), post(http, route, large, "gzip")]
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert inflations == [True, False]  # the small body in place, the large one aside
    if route == "/v1/embeddings":
        assert answers[1].json()["data"] == plain.json()["data"]
    else:
        assert answers[1].json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("route, body", ROUTES)
def test_a_large_plain_body_is_parsed_on_a_worker_thread_and_answered_alike(
        http, route, body, monkeypatch):
    assert PLAIN_ASIDE_BYTES == fastpath.LARGE_BODY_BYTES  # as KServe bodies are
    seen = where_called(monkeypatch, "check_json_size")  # where each body was parsed
    small = orjson.dumps(body)
    large = orjson.dumps({**body, "padding": "x" * PLAIN_ASIDE_BYTES})
    answers = [post(http, route, small), post(http, route, large)]
    assert [r.status_code for r in answers] == [200, 200], [r.text[:300] for r in answers]
    assert seen == [True, False]  # the small body in place, the large one aside
    if route == "/v1/embeddings":
        assert answers[1].json()["data"] == answers[0].json()["data"]
    else:
        assert answers[1].json()["choices"] == answers[0].json()["choices"]


@pytest.mark.parametrize("route, body", ROUTES)
def test_a_large_gzip_bomb_is_413_on_a_worker_thread_without_being_inflated_whole(
        http, route, body, inflations):
    claimed = 128 << 20
    bomb = gzip_bomb(claimed)
    assert COMPRESSED_ASIDE_BYTES < len(bomb) < claimed // 500
    tracemalloc.start()
    try:
        r = post(http, route, bomb, "gzip")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    error = error_of(r, 413)
    assert "inflates to more than" in error["message"] and str(MAX_JSON_BYTES) in error["message"]
    assert inflations == [False]
    # inflating stopped past the limit: what was held is about the limit, not what it claims
    assert peak < 4 * MAX_JSON_BYTES < claimed


# -- JSON types: a boolean is no number, a number no boolean ------------------------------
@pytest.mark.parametrize("route, body, field, value", [
    ("/v1/completions", COMPLETION, "top_p", True),
    ("/v1/completions", COMPLETION, "best_of", True),
    ("/v1/completions", COMPLETION, "echo", 0),
    ("/v1/completions", COMPLETION, "logprobs", False),
    ("/v1/completions", COMPLETION, "presence_penalty", False),
    ("/v1/completions", COMPLETION, "stream", 0),
    ("/v1/completions", COMPLETION, "ignore_eos", 1),
    ("/v1/completions", COMPLETION, "speculative", 0),
    ("/v1/completions", COMPLETION, "max_tokens", True),
    ("/v1/completions", COMPLETION, "user", 7),
    ("/v1/chat/completions", CHAT, "top_p", True),
    ("/v1/chat/completions", CHAT, "logprobs", 0),
    ("/v1/chat/completions", CHAT, "top_logprobs", False),
    ("/v1/chat/completions", CHAT, "frequency_penalty", False),
    ("/v1/chat/completions", CHAT, "modalities", [1]),
    ("/v1/chat/completions", CHAT, "max_completion_tokens", True),
    ("/v1/chat/completions", CHAT, "user", ["someone"]),
])
def test_a_field_of_the_wrong_type_is_400_naming_it(http, route, body, field, value):
    error = error_of(http.post(route, json={**body, field: value}), 400)
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("route, body", [("/v1/completions", COMPLETION),
                                         ("/v1/chat/completions", CHAT)])
def test_neutral_values_of_their_own_type_are_still_taken(http, route, body):
    neutral = {"top_p": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "someone",
               "stream": False, "ignore_eos": False, "stream_options": None}
    if route == "/v1/completions":
        neutral.update(best_of=1, echo=False, logprobs=None, suffix="")
    else:
        neutral.update(logprobs=False, top_logprobs=0, modalities=["text"],
                       response_format={"type": "text"})
    r = http.post(route, json={**body, **neutral})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route, body", [("/v1/completions", COMPLETION),
                                         ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_400(http, route, body, stream):
    sent = {**body, "stream_options": {"include_usage": True}}
    if stream is not None:
        sent["stream"] = stream
    error = error_of(http.post(route, json=sent), 400)
    assert error["param"] == "stream_options"
    assert "only allowed when stream is true" in error["message"]


# -- embeddings: encoding_format, user, dimensions -----------------------------------------
@pytest.mark.parametrize("fmt", [0, "", [], False, "FLOAT", "base_64"])
def test_an_encoding_format_other_than_float_or_base64_is_400(http, fmt):
    error = error_of(http.post("/v1/embeddings", json={**EMBEDDING, "encoding_format": fmt}),
                     400)
    assert error["param"] == "encoding_format"
    assert '"float" or "base64"' in error["message"]


def test_a_null_encoding_format_is_float(http):
    r = http.post("/v1/embeddings", json={**EMBEDDING, "encoding_format": None})
    assert r.status_code == 200, r.text
    assert all(isinstance(x, float) for x in r.json()["data"][0]["embedding"])


@pytest.mark.parametrize("field, value", [("user", 5), ("user", {"id": "x"}),
                                          ("dimensions", True), ("dimensions", "64")])
def test_embedding_fields_of_the_wrong_type_are_400_naming_them(http, field, value):
    error = error_of(http.post("/v1/embeddings", json={**EMBEDDING, field: value}), 400)
    assert error["param"] == field and field in error["message"]


# -- embeddings: which input is at fault -------------------------------------------------
@pytest.mark.parametrize("inputs, index", [("", 0), (["", "a"], 0), (["a", "b", ""], 2)])
def test_an_empty_input_is_400_naming_its_index(http, inputs, index):
    error = error_of(http.post("/v1/embeddings", json={"model": "encoder", "input": inputs}), 400)
    assert error["param"] == "input"
    assert f"input[{index}] is empty" in error["message"]
    assert "INPUT_IDS" not in error["message"]


@pytest.mark.parametrize("inputs, index, tokens", [
    (["a", "b", "c", "x" * 129], 3, 129),
    ([[5, 6], [7] * 500], 1, 500),
    ("\u00e9" * 100, 0, 200),  # a text's tokens, not its characters: two bytes each here
])
def test_an_input_longer_than_the_model_reads_is_400_naming_its_index_and_the_limit(
        http, inputs, index, tokens):
    error = error_of(http.post("/v1/embeddings", json={"model": "encoder", "input": inputs}), 400)
    assert error["param"] == "input"
    message = error["message"]
    assert f"input[{index}] has {tokens} tokens, more than the 128 model 'encoder'" in message
    assert "shorten it, or split it into several inputs" in message
    assert "INPUT_IDS" not in message


def test_an_input_of_exactly_the_model_s_length_is_embedded(http):
    r = http.post("/v1/embeddings", json={"model": "encoder", "input": ["a", "x" * 128]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 129


def test_a_text_too_long_names_input_as_the_param(http):
    r = http.post("/v1/embeddings", json={"model": "encoder", "input": ["a", "x" * 60_000]})
    error = error_of(r, 413)
    assert error["param"] == "input" and "input[1] has 60000 characters" in error["message"]


@pytest.mark.parametrize("route, body, param, fragment", [
    ("/v1/completions", {**COMPLETION, "prompt": [1] * 4000, "max_tokens": 1}, "prompt",
     "shorten it to at most"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2], "max_tokens": 100_000}, "max_tokens",
     "ask for at most"),
    ("/v1/completions", {**COMPLETION, "prompt": [10 ** 9]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {**COMPLETION, "priority": 99}, "priority", "priority=99"),
    ("/v1/completions", {**COMPLETION, "timeout_ms": -5}, "timeout_ms", "timeout_ms=-5"),
    ("/v1/embeddings", {**EMBEDDING, "priority": 99}, "priority", "priority=99"),
])
def test_a_value_the_engine_refuses_names_its_field(http, route, body, param, fragment):
    r = http.post(route, json=body)
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"]
