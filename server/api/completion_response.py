"""The answer of POST /v1/completions: its shape, and how samples become its choices, whole or streamed.

Choice `index` runs prompt by prompt, then over the `n` samples of each. With `best_of`
the `n` samples with the highest total log-probability are kept, best first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from model.io.vocabulary import Vocabulary
from server.api.completion_request import CompletionRequest
from server.api.sample_text import SampleText, TextChunk
from server.engine.types import Generation, PromptScores, SampleResult


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose decode state the prefix cache held: not prefilled again


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


@dataclass
class PromptSamples:
    """One prompt's samples as they build up."""

    prompt: list[int]
    scores: PromptScores | None
    texts: list[SampleText]
    finish: list[str | None]
    cached: int = 0  # its tokens the prefix cache gave (its samples share one prefill)


@dataclass
class TextCompletion:
    """One request's samples, prompt by prompt, and the choices they make."""

    body: CompletionRequest
    model: str
    id: str
    vocabulary: Vocabulary
    parts: list[PromptSamples] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    generated_tokens: int = 0

    def add_prompt(self, prompt: list[int], scores: PromptScores | None) -> None:
        echo = self.body.echo
        prefix, logprobs = (prompt, scores.logprobs if scores else []) if echo else ([], [])
        tops = (scores.top_logprobs or []) if echo and scores else []
        shown = self.body.output_vocabulary(self.vocabulary)
        include_stop = self.body.include_stop_str_in_output
        texts = [
            SampleText(self.body.stop_bytes(), prefix, list(logprobs), list(tops), shown, include_stop)
            for _ in range(self.body.samples)
        ]
        self.parts.append(PromptSamples(prompt, scores, texts, [None] * self.body.samples))

    def add(self, part: int, event: Generation) -> None:
        self.generated_tokens += 1
        self.parts[part].texts[event.sample].push(event.token, event.logprob, event.top_logprobs)
        if event.finish_reason:
            self.parts[part].cached = max(self.parts[part].cached, event.cached_tokens)
            self._end(part, event.sample, event.finish_reason, event.matched_stop)

    def add_result(self, part: int, result: SampleResult) -> None:
        """A whole sample at once (non-streamed)."""
        text = self.parts[part].texts[result.sample]
        count = len(result.tokens)
        for token, logprob, top in zip(
            result.tokens, result.logprobs or [None] * count, result.top_logprobs or [None] * count
        ):
            text.push(token, logprob, top)
        self.generated_tokens += count
        self.parts[part].cached = max(self.parts[part].cached, result.cached_tokens)
        self._end(part, result.sample, result.finish_reason, result.matched_stop)

    def end_without_generating(self) -> None:
        """max_tokens 0: every sample ends at once, by length."""
        if self.body.max_tokens == 0:
            for part in self.parts:
                part.finish = ["length"] * len(part.finish)

    def _end(self, part: int, sample: int, finish_reason: str, matched_stop: bytes | None) -> None:
        text = self.parts[part].texts[sample]
        generated = text.tokens[len(text.prefix) :]
        text.end(matched_stop, self.body.ended_by_stop_token(generated, finish_reason, matched_stop))
        self.parts[part].finish[sample] = finish_reason

    def opening_choices(self) -> list[dict[str, Any]]:
        """The choices a stream starts with, before any token: with echo, each prompt's text."""
        if not self.body.echo:
            return []
        return [
            self.choice(self.index(p, i), p, i, text.take())
            for p, part in enumerate(self.parts)
            for i, text in enumerate(part.texts)
        ]

    def index(self, part: int, sample: int) -> int:
        return part * self.body.n + sample

    def choice(self, index: int, part: int, sample: int, chunk: TextChunk) -> dict[str, Any]:
        return {
            "text": chunk.text,
            "index": index,
            "logprobs": self._logprobs(chunk),
            "finish_reason": self.parts[part].finish[sample],
        }

    def final_choices(self) -> list[dict[str, Any]]:
        """Every choice whole: with best_of, each prompt's n most likely samples, best first."""
        choices = []
        for p, part in enumerate(self.parts):
            for rank, sample in enumerate(self._kept(part)):
                choices.append(self.choice(self.index(p, rank), p, sample, part.texts[sample].take(final=True)))
        return choices

    def _kept(self, part: PromptSamples) -> list[int]:
        samples = range(len(part.texts))
        if self.body.samples == self.body.n:
            return list(samples)
        return sorted(samples, key=lambda s: -part.texts[s].generated_logprob())[: self.body.n]

    def _logprobs(self, chunk: TextChunk) -> dict[str, Any] | None:
        wanted = self.body.logprobs
        if wanted is None:
            return None
        shown = self.vocabulary.shown
        tops = [
            _top_dict(shown, t, lp, top, wanted) for t, lp, top in zip(chunk.tokens, chunk.logprobs, chunk.top_logprobs)
        ]
        return {
            "tokens": [shown[t] for t in chunk.tokens],
            "token_logprobs": chunk.logprobs,
            "top_logprobs": tops,
            "text_offset": chunk.offsets,
        }

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(part.prompt) for part in self.parts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.generated_tokens,
            "total_tokens": prompt + self.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(part.cached for part in self.parts)},
        }


def _top_dict(shown: tuple[str, ...], token: int, logprob: float | None, top, wanted: int) -> dict[str, float] | None:
    """OpenAI's top_logprobs entry: the `wanted` most likely tokens, plus the chosen one."""
    if logprob is None:
        return None
    entry: dict[str, float] = {}
    for t, lp in (top or [])[:wanted]:
        entry.setdefault(shown[t], lp)  # two tokens may look alike (a special token's name as text): keep the likelier
    entry.setdefault(shown[token], logprob)
    return entry
