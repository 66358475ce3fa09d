"""The answer of POST /v1/chat/completions: its shape, and how samples become chat choices.

A chat's samples come back as assistant messages, or streamed as `chat.completion.chunk` deltas opened by
the role. Log-probabilities take the chat shape: each token with its bytes and its most likely alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from server.api.completion_response import TextCompletion, Usage
from server.api.sample_text import TextChunk


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
