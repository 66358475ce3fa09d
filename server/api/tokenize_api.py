"""POST /tokenize and /detokenize: a text model's own tokens for a text, and the text of tokens (vLLM's routes).

A client counts what a prompt costs (`max_tokens` and `usage` are in these tokens) or builds token prompts and
`logit_bias` keys without a copy of the tokenizer: byte models answer with UTF-8 bytes, imported models with
their tokenizer's ids.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.api.errors import FieldError
from server.api.schemas import Int, OrDefault, lone_surrogate


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = Field(None, description="a text model from GET /v1/models; may be left out when only one")
    prompt: str = Field(description="the text to tokenize")
    add_special_tokens: OrDefault(
        bool,
        True,
        description="as the completions route reads a text prompt: the special tokens the tokenizer adds (Llama's "
        "<s>; none for GPT-2 or byte models); false: the text's own tokens only",
    )
    return_token_strs: OrDefault(bool, False, description="also return each token as `logprobs` shows it")

    @field_validator("prompt")
    @classmethod
    def _encodable(cls, prompt: str) -> str:
        bad = lone_surrogate(prompt)
        if bad is not None:
            raise FieldError(
                f"prompt contains a lone UTF-16 surrogate (U+{ord(bad):04X}); send valid Unicode", "prompt"
            )
        return prompt


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(description="the longest sequence (prompt and generated tokens) the model takes")
    tokens: list[int]
    token_strs: list[str] | None = Field(
        None, description="each token as `logprobs` shows it, with return_token_strs (else null)"
    )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = Field(None, description="a text model from GET /v1/models; may be left out when only one")
    tokens: list[Int(ge=0)] = Field(description="token ids of the model's vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str
