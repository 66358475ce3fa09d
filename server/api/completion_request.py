"""The body of POST /v1/completions: its fields and their validation, and the options the chat endpoint shares.

OpenAI's legacy completions: `prompt` is a string, a list of strings, a list of
token ids or a list of such lists (a byte model's tokens are bytes; an imported
model's are its tokenizer's, model/io/vocabulary.py). `best_of` draws more samples
than the `n` returned (completion_response.py keeps the likeliest).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from model.io.vocabulary import Vocabulary
from server.api.errors import FieldError
from server.api.schemas import MAX_N, Float, Int, OrDefault, TextSamplingOptions, integral

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
