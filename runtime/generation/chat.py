"""Chat messages and the template that turns them into one prompt text.

``/v1/chat/completions`` takes OpenAI's ``messages``; ``parse_messages`` checks them
and ``ChatTemplate.render`` writes them as the prompt the model continues. A model
names its template as ``GenerationModel.chat_template``; a model without one (None)
serves ``/v1/completions`` only.

``ROLE_TAGS``, the template every bundled generation model uses, marks each message
with its role on a line of its own and ends with the assistant's tag, so the model's
continuation is the assistant's reply::

    <|system|>
    You are terse.
    <|user|>
    Hello!
    <|assistant|>

The tags are plain text (a byte-level tokenizer reads them as bytes); a model with a
vocabulary of its own would give its own template instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.api.errors import ClientError

#: the roles a message may have (OpenAI's "developer" is the newer name of "system")
ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class MessageError(ClientError):
    """``messages`` is not a list of chat messages this server can render."""

    param = "messages"


@dataclass(frozen=True)
class ChatTemplate:
    """One message per ``message_format`` (with ``{role}`` and ``{content}``), then
    ``reply_prefix``, where the assistant's reply begins."""

    name: str
    message_format: str
    reply_prefix: str

    def render(self, messages: list[ChatMessage]) -> str:
        return "".join(self.message_format.format(role=m.role, content=m.content)
                       for m in messages) + self.reply_prefix


ROLE_TAGS = ChatTemplate("role-tags", "<|{role}|>\n{content}\n", "<|assistant|>\n")


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise MessageError(f"{where}.content holds a part that is not "
                                   '{"type": "text", "text": "..."}; only text parts are '
                                   "supported")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(f"{where}.content must be a string or a list of text parts")


#: the most messages one chat request may hold
MAX_MESSAGES = 1024


def parse_messages(messages: Any) -> list[ChatMessage]:
    """The chat messages of a request body, checked: a non-empty list of objects with a
    role from ``ROLES`` and text content. Raises ``MessageError`` naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages is required: a non-empty list like "
                           '[{"role": "user", "content": "Hello!"}]')
    if len(messages) > MAX_MESSAGES:
        raise MessageError(f"messages holds {len(messages)} messages; at most {MAX_MESSAGES} "
                           "make one conversation here")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise MessageError(f"{where} must be an object with a role and a content")
        role = message.get("role")
        if role not in ROLES:
            raise MessageError(f"{where}.role={role!r} is not supported; use one of "
                               f"{list(ROLES)} (tools and function calls are not supported)")
        if message.get("tool_calls") or message.get("function_call"):
            raise MessageError(f"{where} carries tool calls, which this server does not "
                               "support")
        if "content" not in message or message["content"] is None:
            raise MessageError(f"{where} has no content")
        out.append(ChatMessage(role, _text_of(message["content"], where)))
    return out
