"""Request fields the generation endpoints share: sampling options (every route) and vLLM's extras (text routes)."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from model.decode.sampling import SamplingParams
from model.io.vocabulary import Vocabulary

from server.api.errors import FieldError

MAX_N = 64  # samples per request; the server's --max-batch may allow fewer


def integral(value: Any) -> Any:
    """JSON's 1.0 is an integer (JSON Schema says so); strict validation would refuse it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**constraints: Any) -> Any:
    """An integer field of a strict model, with its bounds (inside, so the JSON schema shows them)."""
    return Annotated[int, Field(**constraints), BeforeValidator(integral)]


def Float(**constraints: Any) -> Any:
    """A float field with its bounds; NaN and Infinity are refused by the models' `allow_inf_nan=False`."""
    return Annotated[float, Field(**constraints)]


MAX_TOP_K = 1 << 20  # past any vocabulary: a bound only so that the number stays an int64


def OrDefault(kind: Any, default: Any, **field: Any) -> Any:
    """`kind`, where JSON null means `default`: OpenAI documents its optional fields as nullable, and clients
    send null for "not set". The schema shows null as allowed; the validated value is never None."""
    return Annotated[kind | None, Field(default, **field), AfterValidator(lambda v: default if v is None else v)]


class SamplingOptions(BaseModel):
    # Strict: JSON `false` is no number and "5" no integer. Multipart forms, whose values are all
    # text, are validated with strict=False (routes_images._from_form). NaN and Infinity, which both
    # JSON parsers here accept, are refused as not finite rather than as out of range.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    n: OrDefault(Int(ge=1, le=MAX_N), 1, description="samples to draw (at most --max-batch)")
    temperature: OrDefault(Float(ge=0.0, le=10.0), 1.0, description="0 = greedy")
    top_p: OrDefault(Float(gt=0.0, le=1.0), 1.0)
    top_k: OrDefault(
        Int(ge=-1, le=MAX_TOP_K), 0, description="-1 or 0 = off (as vLLM); more than the vocabulary keeps every token"
    )
    seed: Int(ge=0, lt=2**62) | None = Field(None, description="sample i uses seed + i; default random")

    @model_validator(mode="before")
    @classmethod
    def _nolone_surrogates(cls, data: Any) -> Any:
        """JSON may carry lone UTF-16 surrogates (\\ud800); no text can be encoded from them."""
        if isinstance(data, dict):
            for name, value in data.items():
                bad = lone_surrogate(value)
                if bad is not None:
                    raise FieldError(
                        f"{name} contains a lone UTF-16 surrogate (U+{ord(bad):04X}); send valid Unicode text",
                        str(name),
                    )
        return data

    def sampling(self, **extra: Any) -> SamplingParams:
        """The options as engine parameters, plus endpoint-specific ones (penalties, bias)."""
        seed = self.seed if self.seed is not None else secrets.randbits(31)
        top_k = max(self.top_k, 0)  # vLLM's -1 is off, as 0
        return SamplingParams(
            temperature=self.temperature, top_k=top_k, top_p=self.top_p, seed=seed, **self.engine_extras(), **extra
        )

    def engine_extras(self) -> dict[str, Any]:
        """Further engine parameters a subclass's fields give (TextSamplingOptions)."""
        return {}


class TextSamplingOptions(SamplingOptions):
    """What every text generation route takes beyond the shared options: vLLM's sampling extras."""

    min_p: OrDefault(
        Float(ge=0.0, le=1.0), 0.0, description="drop tokens less likely than min_p times the most likely; 0 = off"
    )
    repetition_penalty: OrDefault(
        Float(ge=0.01, le=100.0),  # bounded so that every penalized logit stays finite, a greedy row's too
        1.0,
        description="a token seen in the prompt or generated: its logit divided by this if positive, multiplied "
        "if negative (CTRL's, as Hugging Face and vLLM); 0.01-100, 1 = off",
    )
    min_tokens: OrDefault(
        Int(ge=0),
        0,
        description="the end-of-text and stop tokens are held back, and stop sequences do not end the "
        "sample, until this many tokens are generated",
    )
    ignore_eos: OrDefault(bool, False, description="generate past the end-of-text token")
    stop_token_ids: list[Int(ge=0)] | None = Field(
        None, description="token ids that end a sample as the end-of-text token does"
    )
    include_stop_str_in_output: OrDefault(
        bool, False, description="keep the stop sequence or stop token that ended a sample in its text"
    )
    skip_special_tokens: OrDefault(
        bool, True, description="leave special tokens' text (e.g. <|endoftext|>) out of the output"
    )

    def engine_extras(self) -> dict[str, Any]:
        return {
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
        }

    def output_vocabulary(self, vocabulary: Vocabulary) -> Vocabulary:
        """The vocabulary the answer's text is made with: special tokens' names in it or not (skip_special_tokens)."""
        return vocabulary if self.skip_special_tokens else vocabulary.with_special_text

    def ended_by_stop_token(self, tokens: list[int], finish_reason: str | None, matched_stop: bytes | None) -> bool:
        """Whether a sample's last token is one of stop_token_ids that ended it (its text then goes, unless
        include_stop_str_in_output)."""
        return (
            finish_reason == "stop" and not matched_stop and bool(tokens) and tokens[-1] in (self.stop_token_ids or ())
        )


def lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a string, or in the strings of a list (nested), if any."""
    if isinstance(value, str):
        return next((ch for ch in value if "\ud800" <= ch <= "\udfff"), None)
    if isinstance(value, list):
        return next((bad for item in value if (bad := lone_surrogate(item)) is not None), None)
    return None
