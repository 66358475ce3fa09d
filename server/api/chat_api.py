"""The chat completions API's request and response shapes, and how samples become chat choices.

OpenAI's chat completions on top of the completions machinery (text_api.py): the messages are rendered
through the model's chat template (model/io/chat_template.py) into one prompt, and the request becomes one
completion of that prompt (`as_completion`); its samples come back as assistant messages, or streamed as
`chat.completion.chunk` deltas opened by the role. Log-probabilities take the chat shape: each token with
its bytes and its most likely alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.api.errors import FieldError
from server.api.schemas import Int, OrDefault, lone_surrogate
from server.api.text_api import CompletionRequest, TextCompletion, TextGenerationOptions, Usage
from server.api.textcodec import TextChunk

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id")
TOP_LOGPROBS_KEPT = 5  # the engine keeps this many alternatives per token (OpenAI's API allows up to 20)
OPENAI_TOP_LOGPROBS = 20
PART_SHAPE = '{"type": "text", "text": "..."}'


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] = Field(description="text, or a list of text parts (joined by newlines)")
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(TextGenerationOptions):
    messages: list[ChatMessage] = Field(
        description="the conversation so far, rendered into the prompt by the model's chat template"
    )
    max_completion_tokens: Int(ge=1) | None = Field(
        None, description="tokens to generate per sample; default: as many as the model's context leaves"
    )
    max_tokens: Int(ge=1) | None = Field(None, description="the older name of max_completion_tokens")
    logprobs: OrDefault(bool, False, description="the log-probability of each generated token")
    top_logprobs: Int(ge=0, le=OPENAI_TOP_LOGPROBS) | None = Field(
        None, description="with logprobs, the N most likely tokens at each position (this server: N <= 5)"
    )

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, messages: Any) -> Any:
        """One clear message per mistake, naming the message at fault, instead of pydantic's per-branch errors."""
        if not isinstance(messages, list) or not messages:
            raise FieldError(
                'messages must be a non-empty list of messages such as {"role": "user", "content": "Hello"}',
                "messages",
            )
        for i, message in enumerate(messages):
            check_message(message, f"messages[{i}]")
        return messages

    @model_validator(mode="after")
    def _check_combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs needs logprobs set to true", "top_logprobs")
        if (self.top_logprobs or 0) > TOP_LOGPROBS_KEPT:
            raise FieldError(
                f"top_logprobs is {self.top_logprobs}; this server returns at most {TOP_LOGPROBS_KEPT} "
                f"alternatives per token (OpenAI's API allows up to {OPENAI_TOP_LOGPROBS})",
                "top_logprobs",
            )
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise FieldError(
                f"max_tokens ({both[0]}) and max_completion_tokens ({both[1]}) disagree; "
                "give max_completion_tokens only",
                "max_completion_tokens",
            )
        return self

    def chat(self) -> list[dict[str, Any]]:
        """The messages as a chat template reads them: dicts, each content one string."""
        return [{**m.model_dump(exclude_none=True), "content": content_text(m.content)} for m in self.messages]

    def as_completion(self, prompt: list[int], room: int) -> CompletionRequest:
        """The completion of `prompt` this chat asks for: its shared options as they are and, when no limit is
        given, as many tokens as the model's context has `room` for."""
        shared = {name: getattr(self, name) for name in TextGenerationOptions.model_fields}
        limit = self.max_completion_tokens or self.max_tokens or max(room, 1)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # Constructed, not validated again: every value was validated as this chat's, with its own messages.
        return CompletionRequest.model_construct(**shared, prompt=prompt, max_tokens=limit, logprobs=logprobs)


def check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise FieldError(f'{where} must be an object such as {{"role": "user", "content": "Hello"}}', "messages")
    unknown = next((key for key in message if key not in MESSAGE_FIELDS), None)
    if unknown is not None:
        raise FieldError(
            f"{where} has the field {unknown!r}, which this server does not take; a message has "
            f"{', '.join(MESSAGE_FIELDS)}",
            "messages",
        )
    role = message.get("role")
    if role not in ROLES:
        got = "no role" if role is None else f"the role {role!r}"
        raise FieldError(f"{where} has {got}; expected one of {', '.join(ROLES)}", "messages")
    check_content(message.get("content"), where)
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise FieldError(f"{where}.{key} must be a string", "messages")
    if (bad := lone_surrogate(list(strings_of(message)))) is not None:
        raise FieldError(
            f"{where} contains a lone UTF-16 surrogate (U+{ord(bad):04X}); send valid Unicode text", "messages"
        )


def check_content(content: Any, where: str) -> None:
    if content is None:
        raise FieldError(
            f"{where} has no content; expected a string or a list of text parts such as {PART_SHAPE}", "messages"
        )
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise FieldError(f"{where}.content must be a string or a list of text parts such as {PART_SHAPE}", "messages")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise FieldError(
                f"{where}.content[{j}] is not a text part; these models read text only: {PART_SHAPE}", "messages"
            )
        if set(part) != {"type", "text"}:
            raise FieldError(f"{where}.content[{j}] has fields other than type and text", "messages")


def strings_of(message: dict[str, Any]):
    for value in message.values():
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            yield from (part["text"] for part in value)


def content_text(content: str | list[TextPart]) -> str:
    """A message's content as one string: text parts joined by newlines, as vLLM joins them for text models."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


@dataclass
class ChatCompletion(TextCompletion):
    """A chat's samples as chat choices: whole assistant messages, or (streamed) deltas opened by the role."""

    def opening_choices(self) -> list[dict[str, Any]]:
        """Streamed, every choice starts with the role of the message that follows."""
        opening = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{"index": i, **opening} for i in range(self.body.n)]

    def choice(self, index: int, part: int, sample: int, chunk: TextChunk) -> dict[str, Any]:
        finish = self.parts[part].finish[sample]
        if self.body.stream:
            delta = {"content": chunk.text} if chunk.text or chunk.tokens else {}
            return {"index": index, "delta": delta, "logprobs": self._logprobs(chunk), "finish_reason": finish}
        message = {"role": "assistant", "content": chunk.text}
        return {"index": index, "message": message, "logprobs": self._logprobs(chunk), "finish_reason": finish}

    def _logprobs(self, chunk: TextChunk) -> dict[str, Any] | None:
        wanted = self.body.logprobs
        if wanted is None:
            return None
        content = [
            {**self._token(token, logprob), "top_logprobs": [self._token(t, lp) for t, lp in (top or [])[:wanted]]}
            for token, logprob, top in zip(chunk.tokens, chunk.logprobs, chunk.top_logprobs)
        ]
        return {"content": content}

    def _token(self, token: int, logprob: float | None) -> dict[str, Any]:
        """A token as chat logprobs show it: its text, and the bytes it adds (none for a special token)."""
        piece = self.vocabulary.pieces[token]
        return {"token": self.vocabulary.shown[token], "logprob": logprob, "bytes": list(piece) if piece else None}

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.body.stream else "chat.completion"
        return {**super().envelope(choices), "object": kind}
