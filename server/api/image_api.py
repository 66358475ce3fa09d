"""The image completion API's request and response shapes, as the OpenAPI document shows them.

JSON bodies are `ImageCompletionRequest`; multipart bodies carry the same
options as form fields, the digit as an `image` file (or a `pixels` JSON
field) and optionally a `mask` file.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from server.api.errors import FieldError
from server.api.image_particles import DEFAULT_PARTICLES, MAX_PARTICLES
from server.api.imaging import SIDE
from server.api.responses import GENERATION_ERRORS, SSE
from server.api.schemas import Int, OrDefault, SamplingOptions
from server.api.completion_response import PromptTokensDetails

Grid = list[list[Int()]]


class ImageOptions(SamplingOptions):
    model: str | None = Field(
        None, description="an mnist model from GET /v1/models; may be left out when only one is loaded"
    )
    stream: OrDefault(bool, False, description="send rows as server-sent events as they complete")
    keep_rows: Int(ge=0, le=SIDE) | None = Field(None, description="rows 0..k-1 known, the rest unknown")
    particles: Int(ge=1, le=MAX_PARTICLES) | None = Field(
        None,
        description="particles per sample (sequential Monte Carlo, weighed by the known pixels that follow "
        f"unknown ones); n x particles must fit --max-batch. Default: {DEFAULT_PARTICLES} (fewer "
        "if they do not fit) when a known pixel follows an unknown one, else 1",
    )


class ImageCompletionRequest(ImageOptions):
    image: str | None = Field(None, description="base64 PNG, 28x28; alpha 0 marks unknown pixels")
    pixels: Grid | None = Field(None, description="28 rows of 28 grey levels 0-255")
    mask: str | Grid | None = Field(
        None, description="base64 PNG (white = unknown) or 28x28 of 0/1 or false/true (1, true = unknown)"
    )

    @field_validator("mask", mode="before")
    @classmethod
    def _mask_as_levels(cls, mask: Any) -> Any:
        """A grid of booleans reads as 0/1; a mask of another type gets one message, not one per branch of the union."""
        if mask is None or isinstance(mask, str):
            return mask
        if not isinstance(mask, list) or not all(isinstance(row, list) for row in mask):
            raise FieldError(
                f"mask must be a base64 PNG string or {SIDE} rows of {SIDE} values 0/1 or false/true, got {mask!r:.60}",
                "mask",
            )
        return [[int(v) if isinstance(v, bool) else v for v in row] for row in mask]

    @model_validator(mode="after")
    def _one_image(self) -> "ImageCompletionRequest":
        if (self.image is None) == (self.pixels is None):
            raise FieldError(
                "give the digit as exactly one of `image` (base64 PNG) or `pixels` (28x28 grey levels)", "image"
            )
        return self


class SampleParticles(BaseModel):
    resamplings: int
    effective_sample_size: float = Field(description="of the final weights, 1..particles")
    known_log_likelihood: float | None = Field(description="estimate of log p(known pixels), nats; null if 0")


class ImageEntry(BaseModel):
    index: int
    png_base64: str
    pixels: Grid
    particles: SampleParticles | None = None


class ParticleUsage(BaseModel):
    per_sample: int
    resamplings: int | None = Field(None, description="over all samples")
    effective_sample_size: float | None = Field(None, description="the samples' lowest final one")
    known_log_likelihood: float | None = Field(None, description="log p(known pixels), nats, over the samples")
    note: str | None = Field(None, description="why fewer particles ran than asked")


class ImageUsage(BaseModel):
    pixels_generated: int
    seconds: float
    pixels_per_second: float | None
    prompt_tokens_details: PromptTokensDetails  # cached_tokens: known pixels the prefix cache held
    particles: ParticleUsage


class ImageCompletionResponse(BaseModel):
    id: str
    object: str = "image.completion"
    created: int
    model: str
    data: list[ImageEntry]
    usage: ImageUsage


def _multipart_schema() -> dict[str, Any]:
    """The form fields: every option as in JSON, the digit as a file (or `pixels` as JSON text), a mask file.
    A form cannot send null: a field is left out instead, so no option is nullable here."""
    options = {name: _not_null(field) for name, field in ImageOptions.model_json_schema()["properties"].items()}
    files = {
        "image": {"type": "string", "format": "binary", "description": "28x28 PNG; alpha 0 marks unknown pixels"},
        "mask": {"type": "string", "format": "binary", "description": "28x28 PNG, white = unknown"},
        "pixels": {"type": "string", "description": "instead of `image`: 28x28 grey levels as JSON text"},
    }
    return {"type": "object", "properties": {**files, **options}, "required": ["image"]}


def _not_null(field: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema property without its null branch (`anyOf: [X, null]` -> X)."""
    branches = [b for b in field.get("anyOf", []) if b.get("type") != "null"]
    if len(branches) != 1:
        return field
    rest = {k: v for k, v in field.items() if k not in ("anyOf", "default")}
    return {**branches[0], **rest}


IMAGE_REQUEST_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": ImageCompletionRequest.model_json_schema()},
        "multipart/form-data": {"schema": _multipart_schema()},
    },
}

IMAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ImageCompletionResponse,
        "description": "the completions as JSON; one PNG strip with `Accept: image/png`; rows as server-sent "
        "events with `stream: true`",
        "content": {"image/png": {"schema": {"type": "string", "format": "binary"}}, **SSE},
    },
    **GENERATION_ERRORS,
}
