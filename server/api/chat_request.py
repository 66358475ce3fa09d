"""The body of POST /v1/chat/completions: its messages and options, their validation, and the prompt they make.

OpenAI's chat completions on top of the completions machinery: the messages are rendered
through the model's chat template (model/io/chat_template.py) into one prompt, and the request becomes one
completion of that prompt (`as_completion`); chat_response.py shapes its samples as chat choices.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from model.io.chat_template import ChatTemplate, ChatTemplateError
from server.api.completion_request import CompletionRequest, TextGenerationOptions
from server.api.errors import FieldError, invalid_request
from server.api.schemas import Int, OrDefault, lone_surrogate
from server.engine.base import EngineHandle

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


def chat_prompt(engine: EngineHandle, template: ChatTemplate | None, body: ChatCompletionRequest) -> list[int]:
    """The model's tokens for the conversation: its template's text, tokenized with no special tokens added."""
    if template is None:
        raise invalid_request(
            f"model '{engine.name}' has no chat template, so it cannot chat: its file holds none (a byte model, or "
            "a Hugging Face folder imported without chat_template.jinja or tokenizer_config.json's chat_template); "
            "start the server with --chat-template FILE to give one, or use POST /v1/completions",
            "model",
            "no_chat_template",
        )
    try:
        text = template.render(body.chat())
    except ChatTemplateError as exc:
        raise invalid_request(
            f"the chat template of model '{engine.name}' failed on these messages: {exc}",
            "messages",
            "chat_template_error",
        ) from None
    return engine.vocabulary.encode(text, add_special_tokens=False)
