"""What a ``/v1/completions`` or ``/v1/chat/completions`` body asks for, checked.

``parse_completion(raw, content_encoding)`` and ``parse_chat(raw, content_encoding)``
turn a request body (and its ``Content-Encoding``: gzip and deflate are inflated,
another coding is a 415, ``runtime.server.openai_http.read_object``) into a
``GenerationRequest`` or raise ``InvalidParam`` (400, naming the field). The fields
both routes share:

    model           a served generation model (GET /v1/models)
    max_tokens      1 ... (chat: also max_completion_tokens); default: the model's
                    default_max_new_tokens
    n               choices per prompt, 1 ... 128 (with a seed, choice i samples with seed + i);
                    prompts x n at most ``MAX_CHOICES``
    temperature     0 ... 2; 0 (the default here) is greedy
    seed            a 64-bit signed integer; without one a sampled request gets a fresh seed
    stop            a string or a list of up to 4 non-empty strings of at most 256 characters
    stream          Server-Sent Events; stream_options.include_usage adds a usage chunk
                    (stream_options only with stream true, as OpenAI)
    user            a string, the end user's id (not used)
    priority*       0 (most urgent) ... priority_levels - 1, as in vLLM
    timeout_ms*     how long the request may wait for its first step
    ignore_eos*     keep generating past the end token (benchmarks)
    speculative*    false: no speculative decoding for this request; true: ask for it (a
                    model served without a proposer serves it without, and counts it)

(* extensions.) Fields for features this server does not have (logprobs, tools,
penalties, top_p other than 1, ...) are refused unless they hold their neutral
value (of the same JSON type: ``top_p: true`` or ``logprobs: false`` on completions is
refused, never read as 1 or 0); unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.generation.chat import ChatMessage, parse_messages
from runtime.server.openai_errors import InvalidParam
from runtime.server.openai_http import read_object

MAX_N = 128
#: the most choices one request may ask for: its prompts x n
MAX_CHOICES = 256
MAX_STOPS = 4
MAX_STOP_CHARS = 256
_SEED_RANGE = (-(2 ** 63), 2 ** 63)

#: fields accepted only at a neutral value, with what to do instead
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_p": ((None, 1, 1.0), "top_p must be 1: sampling uses the whole distribution"),
    "presence_penalty": ((None, 0, 0.0), "presence_penalty must be 0"),
    "frequency_penalty": ((None, 0, 0.0), "frequency_penalty must be 0"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
}
_COMPLETION_NEUTRAL = {
    **_NEUTRAL,
    "best_of": ((None, 1), "best_of must be 1; use n for several choices"),
    "echo": ((None, False), "echo is not supported"),
    "logprobs": ((None, 0), "logprobs are not supported; leave logprobs null"),
    "suffix": ((None, ""), "suffix is not supported"),
}
_CHAT_NEUTRAL = {
    **_NEUTRAL,
    "logprobs": ((None, False), "logprobs are not supported; leave logprobs false"),
    "top_logprobs": ((None, 0), "top_logprobs are not supported"),
    "tools": ((None, []), "tools are not supported"),
    "tool_choice": ((None, "none"), "tools are not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "response_format": ((None, {"type": "text"}), 'only response_format {"type": "text"} '
                                                  "is supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), 'only modalities ["text"] are supported'),
}


@dataclass(frozen=True)
class GenerationRequest:
    model: str
    #: (token ids, text) per prompt, one of the two None; chat: filled in from ``messages``
    prompts: list[tuple[list[int] | None, str | None]]
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    priority: int | None = None
    timeout_ms: float | None = None
    ignore_eos: bool = False
    #: None: the model's setting; False: opt out of speculative decoding; True: ask for it
    speculative: bool | None = None
    #: chat only: the messages, rendered into ``prompts`` by the model's template
    messages: list[ChatMessage] = field(default_factory=list)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` as JSON means it: a boolean equals only the same boolean
    (Python's ``True == 1`` and ``False == 0`` would let ``best_of: true`` pass for 1 and
    ``echo: 0`` for false), lists and objects item by item; 1 and 1.0 are the same number."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, dict) and isinstance(neutral, dict):
        return value.keys() == neutral.keys() and all(_same(value[k], neutral[k]) for k in value)
    if isinstance(value, list) and isinstance(neutral, list):
        return len(value) == len(neutral) and all(map(_same, value, neutral))
    return value == neutral


def _max_tokens(body: dict[str, Any], key: str) -> int | None:
    """``body[key]`` (max_tokens or max_completion_tokens): None or a positive integer."""
    value = body.get(key)
    if value is not None and not (_is_int(value) and value >= 1):
        raise InvalidParam(key, f"{key}={value!r} must be a positive integer")
    return value


def _flag(body: dict[str, Any], key: str, param: str | None = None) -> bool | None:
    """``body[key]``: None, true or false (never 0 or 1)."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidParam(param or key, f"{key}={value!r} must be true or false")
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """``stream_options``: an object like ``{"include_usage": true}``, given only with
    ``stream: true`` (OpenAI refuses it otherwise: nothing would read it)."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidParam("stream_options", 'stream_options must be an object like '
                                             '{"include_usage": true}')
    _flag(options, "include_usage", "stream_options")
    if not stream:
        raise InvalidParam("stream_options", "stream_options is only allowed when stream is "
                                             "true; set stream to true or leave "
                                             "stream_options out")
    return options


def parse_prompts(prompt: Any) -> list[tuple[list[int] | None, str | None]]:
    """Normalise ``prompt`` to a list of (token ids, text) pairs, one of them None."""
    if isinstance(prompt, str):
        return [(None, prompt)]
    if isinstance(prompt, list) and len(prompt) > MAX_CHOICES and not _is_int(prompt[0]):
        raise InvalidParam("prompt", f"prompt holds {len(prompt)} prompts; at most "
                                     f"{MAX_CHOICES} are generated per request")
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [(list(prompt), None)]
        out: list[tuple[list[int] | None, str | None]] = []
        for item in prompt:
            if isinstance(item, str):
                out.append((None, item))
            elif isinstance(item, list) and item and all(_is_int(t) for t in item):
                out.append((list(item), None))
            else:
                break
        else:
            return out
    raise InvalidParam("prompt", "prompt must be a string, a non-empty list of token ids, or a "
                                 "list of strings / token-id lists (one choice each)")


def parse_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise InvalidParam("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise InvalidParam("stop", f"stop has {len(stops)} strings; at most {MAX_STOPS} are "
                                   "allowed")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidParam("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} "
                                   "characters")
    return tuple(stops)


def _common(body: dict[str, Any], neutral: dict, max_tokens: int | None) -> dict[str, Any]:
    """The fields both routes share, checked, as ``GenerationRequest`` keywords."""
    for key, (allowed, message) in neutral.items():
        if key in body and not any(_same(body[key], a) for a in allowed):
            raise InvalidParam(key, f"{key}={body[key]!r}: {message}")
    if not isinstance(body.get("model"), str):
        raise InvalidParam("model", "model is required: the name of one of GET /v1/models")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidParam("user", f"user={user!r} must be a string (an id of the end user) "
                                   "or left out")
    n = body.get("n")
    n = 1 if n is None else n
    if not (_is_int(n) and 1 <= n <= MAX_N):
        raise InvalidParam("n", f"n={n!r} must be an integer from 1 to {MAX_N}")
    temperature = body.get("temperature")
    temperature = 0 if temperature is None else temperature
    if not (_is_number(temperature) and 0 <= temperature <= 2):
        raise InvalidParam("temperature", f"temperature={temperature!r} must be a number from "
                                          "0 to 2")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and _SEED_RANGE[0] <= seed < _SEED_RANGE[1]):
        raise InvalidParam("seed", f"seed={seed!r} must be a 64-bit signed integer")
    stream, ignore_eos, speculative = (_flag(body, "stream"), _flag(body, "ignore_eos"),
                                       _flag(body, "speculative"))
    options = _stream_options(body, bool(stream))
    priority = body.get("priority")
    if priority is not None and not _is_int(priority):
        raise InvalidParam("priority", f"priority={priority!r} must be an integer (0 is most "
                                       "urgent)")
    timeout_ms = body.get("timeout_ms")
    if timeout_ms is not None and not (_is_number(timeout_ms) and timeout_ms > 0):
        raise InvalidParam("timeout_ms", f"timeout_ms={timeout_ms!r} must be a positive number of "
                                         "milliseconds")
    return {"model": body["model"], "max_tokens": max_tokens, "n": n,
            "temperature": float(temperature), "seed": seed, "stop": parse_stop(body.get("stop")),
            "stream": bool(stream), "include_usage": bool(options.get("include_usage")),
            "priority": priority, "timeout_ms": timeout_ms,
            "ignore_eos": bool(ignore_eos), "speculative": speculative}


def parse_completion(raw: bytes, content_encoding: str | None = None) -> GenerationRequest:
    """A ``/v1/completions`` body (sent with ``content_encoding``): the shared fields and
    ``prompt``."""
    body = read_object(raw, content_encoding)
    common = _common(body, _COMPLETION_NEUTRAL, _max_tokens(body, "max_tokens"))
    if "prompt" not in body:
        raise InvalidParam("prompt", "prompt is required: a string or a list of token ids")
    prompts = parse_prompts(body["prompt"])
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise InvalidParam("prompt", f"{len(prompts)} prompts x n={common['n']} ask for "
                                     f"{len(prompts) * common['n']} choices; at most "
                                     f"{MAX_CHOICES} are generated per request, so send the "
                                     "rest in further requests")
    return GenerationRequest(prompts=prompts, **common)


def parse_chat(raw: bytes, content_encoding: str | None = None) -> GenerationRequest:
    """A ``/v1/chat/completions`` body (sent with ``content_encoding``): the shared fields
    and ``messages`` (``max_completion_tokens`` is the newer name of ``max_tokens``)."""
    body = read_object(raw, content_encoding)
    max_tokens = _max_tokens(body, "max_tokens")
    newer = _max_tokens(body, "max_completion_tokens")
    if max_tokens is not None and newer is not None and max_tokens != newer:
        raise InvalidParam("max_completion_tokens", "max_tokens and max_completion_tokens "
                                                    "differ; send one of them")
    common = _common(body, _CHAT_NEUTRAL, newer if newer is not None else max_tokens)
    return GenerationRequest(prompts=[], messages=parse_messages(body.get("messages")),
                             **common)
