"""The completions API's request and response shapes, and how samples become choices.

OpenAI's legacy completions: `prompt` is a string, a list of strings, a list of
token ids or a list of such lists (a byte model's tokens are bytes; an imported
model's are its tokenizer's, model/io/vocabulary.py); choice `index` runs prompt by prompt, then
over the `n` samples of each. `best_of` draws more samples and keeps the `n`
with the highest total log-probability, best first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.api.errors import FieldError
from server.api.schemas import MAX_N, Float, Int, OrDefault, TextSamplingOptions, integral
from model.io.vocabulary import Vocabulary
from server.api.textcodec import SampleText, TextChunk
from server.engine.types import Generation, PromptScores, SampleResult

MAX_STOPS = 4
MAX_PROMPTS = 16
Token = Int(ge=0)
Penalty = Float(ge=-2.0, le=2.0)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class TextGenerationOptions(TextSamplingOptions):
    """What the text endpoints (completions, chat completions) share beyond sampling: the model, stop
    sequences, streaming, penalties and bias."""

    model: str | None = Field(
        None, description="a text model from GET /v1/models; may be left out when only one is loaded"
    )
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOPS} sequences that end a sample (not included)"
    )
    stream: OrDefault(bool, False)
    stream_options: StreamOptions | None = None
    frequency_penalty: OrDefault(Penalty, 0.0, description="minus this times how often a token was generated so far")
    presence_penalty: OrDefault(Penalty, 0.0, description="minus this once a token has been generated")
    logit_bias: dict[str, Float(ge=-100, le=100)] | None = Field(
        None, description="token id (as a string; 0-255 for byte models) -> bias added to its logit"
    )
    user: str | None = Field(None, description="accepted and ignored")

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop_type(cls, stop: Any) -> Any:
        """One clear message for a stop of the wrong type, instead of one per branch of the union."""
        if stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            return stop
        raise FieldError(f"stop must be a string or a list of up to {MAX_STOPS} strings, got {stop!r:.60}", "stop")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise FieldError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise FieldError("stop sequences must not be empty", "stop")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise FieldError(
                    f'logit_bias keys are token ids written as strings (e.g. "65"), got {key!r}', "logit_bias"
                )
        return bias

    def stop_bytes(self) -> list[bytes]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s.encode("utf-8") for s in stops]

    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class CompletionRequest(TextGenerationOptions):
    prompt: str | list[str] | list[Token] | list[list[Token]] = Field(
        "",
        description="text, token ids (bytes 0-255 for byte models; the tokenizer's for imported models), "
        f"or a list of up to {MAX_PROMPTS} of either",
    )
    suffix: str | None = Field(
        None, description="not supported (these models cannot insert text): leave it out or empty"
    )
    max_tokens: OrDefault(Int(ge=0), 16, description="tokens to generate per sample; 0 with echo scores the prompt")
    logprobs: Int(ge=0, le=5) | None = Field(None, description="log-probability of each token and of the N most likely")
    echo: OrDefault(bool, False, description="put the prompt before the completion")
    best_of: Int(ge=1, le=MAX_N) | None = Field(
        None, description="draw this many, return the n most likely (not with stream)"
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        """One clear message for a malformed prompt, instead of one per branch of the union."""
        items = prompt if isinstance(prompt, list) else [prompt]
        kinds = {str if isinstance(i, str) else list if isinstance(i, list) else "token" for i in items}
        if not isinstance(prompt, (str, list)) or len(kinds) > 1:
            raise FieldError(
                "prompt must be a string, a list of token ids, or a list of strings or of token lists", "prompt"
            )
        for i, item in enumerate(items):
            tokens = item if isinstance(item, list) else [] if isinstance(item, str) else [item]
            bad = next(
                (t for t in map(integral, tokens) if isinstance(t, bool) or not isinstance(t, int) or t < 0),
                None,
            )
            if bad is not None:
                raise FieldError(
                    f"prompt[{i}] holds {bad!r}; tokens are integer ids >= 0 (bytes 0-255 for byte models)", "prompt"
                )
        return prompt

    @model_validator(mode="after")
    def _check_combinations(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError(
                "prompt is an empty list; send a string, byte tokens, or a non-empty list of either", "prompt"
            )
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)) and len(self.prompt) > MAX_PROMPTS:
            raise FieldError(f"at most {MAX_PROMPTS} prompts in one request, got {len(self.prompt)}", "prompt")
        if self.suffix:
            raise FieldError(
                "suffix is not supported: these models generate left to right and cannot insert text", "suffix"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.best_of not in (None, 1) and self.stream:
            raise FieldError("best_of cannot be used with stream (as in OpenAI's API)", "best_of")
        return self

    def prompts(self, vocabulary: Vocabulary) -> list[list[int]]:
        """Each prompt as the model's tokens."""
        if isinstance(self.prompt, str):
            return [vocabulary.encode(self.prompt)]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return [vocabulary.encode(p) if isinstance(p, str) else list(p) for p in self.prompt]

    @property
    def samples(self) -> int:
        """Samples drawn per prompt: best_of when given, else n."""
        return self.best_of or self.n


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
