"""Request bodies of the OpenAI-style routes, chat messages and the OpenAI error shape,
without a server."""

from __future__ import annotations

import orjson
import pytest

from runtime.api.errors import QueueFull, RequestExpired, ValidationError
from runtime.generation.chat import ROLE_TAGS, ChatMessage, MessageError, parse_messages
from runtime.generation.params import parse_chat, parse_completion
from runtime.server.openai_embeddings import parse_inputs
from runtime.server.openai_errors import InvalidParam, openai_answer


def body(**fields) -> bytes:
    return orjson.dumps(fields)


def test_a_completion_body_with_every_shared_field():
    req = parse_completion(body(model="m", prompt=["ab", [1, 2]], max_tokens=5, n=2,
                                temperature=0.5, seed=-3, stop="\n", stream=True,
                                stream_options={"include_usage": True}, priority=0,
                                timeout_ms=250, ignore_eos=True, user="someone", top_p=1))
    assert req.prompts == [(None, "ab"), ([1, 2], None)]
    assert (req.max_tokens, req.n, req.temperature, req.seed) == (5, 2, 0.5, -3)
    assert req.stop == ("\n",) and req.stream and req.include_usage
    assert (req.priority, req.timeout_ms, req.ignore_eos) == (0, 250, True)


def test_chat_takes_either_name_of_max_tokens_but_not_two_different_values():
    assert parse_chat(body(model="m", messages=[{"role": "user", "content": "hi"}],
                           max_completion_tokens=7)).max_tokens == 7
    assert parse_chat(body(model="m", messages=[{"role": "user", "content": "hi"}],
                           max_tokens=7, max_completion_tokens=7)).max_tokens == 7
    with pytest.raises(InvalidParam) as err:
        parse_chat(body(model="m", messages=[{"role": "user", "content": "hi"}],
                        max_tokens=7, max_completion_tokens=8))
    assert err.value.param == "max_completion_tokens"


@pytest.mark.parametrize("fields, param", [
    ({"stop": ["a"] * 5}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"n": 129}, "n"),
    ({"n": True}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"seed": 1.5}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"),
])
def test_unsupported_or_malformed_chat_fields_name_the_field(fields, param):
    with pytest.raises(InvalidParam) as err:
        parse_chat(body(model="m", messages=[{"role": "user", "content": "hi"}], **fields))
    assert err.value.param == param and err.value.http_status == 400


@pytest.mark.parametrize("messages, fragment", [
    (None, "messages is required"),
    ([], "messages is required"),
    (["hi"], "must be an object"),
    ([{"role": "tool", "content": "x"}], "role='tool'"),
    ([{"role": "user"}], "has no content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}], "tool calls"),
])
def test_messages_are_checked(messages, fragment):
    with pytest.raises(MessageError, match=fragment) as err:
        parse_messages(messages)
    assert err.value.param == "messages"


def test_the_role_tags_template():
    messages = parse_messages([{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert messages == [ChatMessage("developer", "Be brief."), ChatMessage("user", "Hi")]
    assert ROLE_TAGS.render(messages) == ("<|developer|>\nBe brief.\n<|user|>\nHi\n"
                                          "<|assistant|>\n")


def test_embedding_inputs():
    assert parse_inputs("x") == ["x"]
    assert parse_inputs([1, 2]) == [[1, 2]]
    assert parse_inputs(["x", [3]]) == ["x", [3]]
    for bad in ([], [[]], [-1], [1.5], None, ["x", 2], [True]):
        with pytest.raises(InvalidParam):
            parse_inputs(bad)
    with pytest.raises(InvalidParam, match="at most 2048"):
        parse_inputs(["x"] * 2049)


def test_openai_error_answers():
    status, headers, raw = openai_answer(ValidationError("priority=9 is out of range"), "w")
    assert status == 400  # OpenAI answers invalid values with 400, never 422
    assert orjson.loads(raw) == {"error": {"message": "priority=9 is out of range",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "invalid"}}
    status, headers, raw = openai_answer(QueueFull("full", retry_after_s=0.2), "w")
    assert status == 429 and (b"retry-after", b"1") in headers
    assert orjson.loads(raw)["error"]["type"] == "rate_limit_error"
    status, _, raw = openai_answer(RequestExpired("too late"), "w")
    assert status == 503 and orjson.loads(raw)["error"] == {
        "message": "too late", "type": "server_error", "param": None, "code": "expired"}
    status, _, raw = openai_answer(InvalidParam("stop", "bad stop"), "w")
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "stop"


def test_a_model_without_a_chat_template_serves_completions_only():
    from starlette.testclient import TestClient

    from runtime.generation.engine import GenerationEngine
    from runtime.generation.http import create_app
    from runtime.models.decoder import TinyDecoder

    class Plain(TinyDecoder):
        name = "plain"
        chat_template = None

    engine = GenerationEngine(Plain(d_model=16, n_layers=1, max_model_len=64))
    with TestClient(create_app({"plain": engine})) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": "plain", "messages": [{"role": "user", "content": "hi"}]})
        plain = client.post("/v1/completions", json={"model": "plain", "prompt": "hi",
                                                      "max_tokens": 2})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    assert "no chat template" in chat.json()["error"]["message"]
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] <= 2
