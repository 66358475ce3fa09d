"""POST /v1/images/completions: complete occluded 28x28 digits.

JSON (`image` base64 PNG or `pixels`) or multipart/form-data (`image`
file). The answer is JSON with each completion as base64 PNG and pixels,
one PNG strip with `Accept: image/png`, or rows as server-sent events with
`stream: true`.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api import imaging
from server.api.deps import ServerState, get_server
from server.engine.base import EngineHandle
from server.engine.streams import GenerationStream
from server.api.errors import APIError, invalid_request, is_json, media_type, raise_validation
from server.api.imaging import PIXELS, SIDE, ImageError, OccludedImage
from server.api.image_api import IMAGE_REQUEST_BODY, IMAGE_RESPONSES, ImageCompletionRequest, ImageOptions
from server.api.image_particles import ParticlePlan, entry_report, plan_particles, usage_report
from server.api.negotiation import choose, media_ranges, stream_type
from server.api.engine_calls import ClientGone, collect, submit
from server.api.sse import SSE_HEADERS, sse, sse_stream
from server.engine.types import Generation, GenerationRequest, ParticleSummary, Progress, SampleResult

router = APIRouter()
FILE_FIELDS = ("image", "mask", "pixels")
Grid = list[list[int]]


@dataclass
class ImageInput:
    """The digit and its occlusion as sent, before decoding."""

    options: ImageOptions
    png: bytes | None = None
    pixels: Grid | None = None
    mask_png: bytes | None = None
    mask_grid: Grid | None = None

    def occluded(self) -> OccludedImage:
        transparent = None
        if self.png is not None:
            decoded = imaging.decode_png(self.png, "image")
            pixels, transparent = decoded.grey, decoded.transparent
        else:
            pixels = imaging.grid_from_lists(self.pixels, "pixels")
        mask = None
        if self.mask_png is not None:
            mask = imaging.mask_from_png(imaging.decode_png(self.mask_png, "mask"))
        elif self.mask_grid is not None:
            mask = imaging.grid_from_lists(self.mask_grid, "mask", 0, 1).astype(bool)
        digit = "image" if self.png is not None else "pixels"
        unknown, source = imaging.choose_unknown(transparent, mask, self.options.keep_rows, digit)
        return imaging.occlude(pixels, unknown, source, digit)


@dataclass
class Canvases:
    """The n completions, filled in as pixels arrive. (n, 784) uint8."""

    occluded: OccludedImage
    n: int
    images: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.images = np.repeat(self.occluded.pixels.reshape(1, PIXELS), self.n, axis=0)

    def add(self, event: Generation) -> int | None:
        """Place one pixel; return its row if that row is now complete."""
        self.images[event.sample, event.position] = event.token
        return event.position // SIDE if event.position % SIDE == SIDE - 1 else None

    def fill(self, result: SampleResult) -> None:
        """Place a whole sample's generated pixels at once."""
        self.images[result.sample, result.start : result.start + len(result.tokens)] = result.tokens

    def rows_after(self, result: SampleResult) -> range:
        """The image rows a whole sample's pixels reach into."""
        return range(result.start // SIDE, SIDE)

    def image(self, sample: int) -> np.ndarray:
        return self.images[sample].reshape(SIDE, SIDE)

    def entry(self, sample: int) -> dict[str, Any]:
        png = base64.b64encode(imaging.encode_png(self.image(sample))).decode("ascii")
        return {"index": sample, "png_base64": png, "pixels": self.image(sample).tolist()}


@dataclass
class ImageJob:
    id: str
    engine: EngineHandle
    canvases: Canvases
    plan: ParticlePlan
    started: float = field(default_factory=time.monotonic)
    summaries: dict[int, ParticleSummary] = field(default_factory=dict)  # per sample, once finished
    cached_tokens: int = 0  # known pixels whose decode state the prefix cache held (its samples share one prefill)

    def finished(self, sample: int, summary: ParticleSummary | None, cached_tokens: int = 0) -> None:
        if summary is not None:
            self.summaries[sample] = summary
        self.cached_tokens = max(self.cached_tokens, cached_tokens)

    def usage(self) -> dict[str, Any]:
        seconds = time.monotonic() - self.started
        pixels = self.canvases.n * self.canvases.occluded.unknown_count
        return {
            "pixels_generated": pixels,
            "seconds": round(seconds, 4),
            "pixels_per_second": round(pixels / seconds, 1) if seconds > 0 else None,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            **usage_report(self.plan, [self.summaries[i] for i in sorted(self.summaries)]),
        }

    def entry(self, sample: int) -> dict[str, Any]:
        return {**self.canvases.entry(sample), **entry_report(self.summaries.get(sample))}

    def record(self) -> None:
        self.engine.metrics.request_latency(time.monotonic() - self.started)
        self.engine.metrics.images_completed(self.canvases.n)


@router.post(
    "/v1/images/completions",
    response_model=None,
    responses=IMAGE_RESPONSES,
    openapi_extra={"requestBody": IMAGE_REQUEST_BODY},
)
async def complete_image(request: Request, server: ServerState = Depends(get_server)) -> Response:
    server.label_model(request, await named_model(request))
    try:
        given = await read_input(request)
        occluded = given.occluded()
    except ImageError as exc:
        raise invalid_request(str(exc), exc.param, exc.code) from None
    options = given.options
    answer = image_answer_type(request.headers.get("accept"), options.stream)
    engine = server.engine_for(request, options.model, "mnist")
    plan = plan_particles(options.particles, occluded, options.n, engine.limits.max_batch, options.temperature)
    job = ImageJob(f"imgcmpl-{uuid.uuid4().hex}", engine, Canvases(occluded, options.n), plan)
    stream = await submit(engine, generation_request(job, options), each_event=options.stream)
    if options.stream:
        return StreamingResponse(
            sse_stream(request, row_events(job, stream), [stream]), media_type="text/event-stream", headers=SSE_HEADERS
        )
    try:
        results = await collect(request, stream)
    except ClientGone:
        request.state.outcome = "cancelled"
        return Response(status_code=499)
    for result in results:
        job.canvases.fill(result)
        job.finished(result.sample, result.particles, result.cached_tokens)
    job.record()
    return finished_image_response(job, answer, options.n)


def finished_image_response(job: ImageJob, answer: str, n: int) -> Response:
    """The finished job's n completions: one PNG strip, or JSON."""
    usage = job.usage()
    if answer == "image/png":
        strip = imaging.encode_strip([job.canvases.image(i) for i in range(n)])
        return Response(
            strip,
            media_type="image/png",
            headers={"X-Pixels-Generated": str(usage["pixels_generated"]), "X-Seconds": str(usage["seconds"])},
        )
    # A JSONResponse skips FastAPI's jsonable_encoder, which would walk the 784 pixels one by one.
    return JSONResponse(
        {
            "id": job.id,
            "object": "image.completion",
            "created": int(time.time()),
            "model": job.engine.name,
            "data": [job.entry(i) for i in range(n)],
            "usage": usage,
        }
    )


def image_answer_type(accept: str | None, stream: bool) -> str:
    """Events when streaming; else a PNG strip when Accept names image/png, JSON otherwise (406 if neither)."""
    if stream:
        return stream_type(accept)
    if "image/png" in media_ranges(accept):
        return "image/png"
    return choose(accept, ["application/json", "image/png"])


def generation_request(job: ImageJob, options: ImageOptions) -> GenerationRequest:
    """The engine validates it: n against --max-batch, the image against the model's max_len."""
    occluded = job.canvases.occluded
    prompt = occluded.prompt()
    return GenerationRequest(
        request_id=job.id,
        prompt=prompt,
        max_new_tokens=PIXELS - len(prompt),
        sampling=options.sampling(),
        n=options.n,
        forced=occluded.forced(),
        particles=job.plan.count,
    )


async def named_model(request: Request) -> object:
    """The `model` field as sent, read before the other fields are checked (None if the body cannot be read:
    read_input then says why). Starlette keeps the body and the parsed form, so nothing is read twice; the body is
    read first so that a form that fails to parse here fails the same way there, not with "stream consumed"."""
    content_type = request.headers.get("content-type")
    try:
        await request.body()
        if media_type(content_type) == "multipart/form-data":
            return (await request.form()).get("model")
        if is_json(content_type):
            body = json.loads(await request.body())
            return body.get("model") if isinstance(body, dict) else None
    except Exception:  # a malformed body of any kind: read_input reports it with its own message
        return None
    return None


async def read_input(request: Request) -> ImageInput:
    content_type = request.headers.get("content-type", "")
    if media_type(content_type) == "multipart/form-data":
        return await _from_form(request)
    if is_json(content_type):
        return await _from_json(request)
    sent = f"content type '{content_type}' is not supported" if content_type else "the body has no content type"
    raise APIError(
        415,
        f"{sent}; send Content-Type: application/json or multipart/form-data with an `image` file",
        None,
        "unsupported_media_type",
    )


async def _from_json(request: Request) -> ImageInput:
    try:
        body = ImageCompletionRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise_validation(exc)
    png = imaging.decode_base64(body.image, "image") if body.image is not None else None
    mask_png = imaging.decode_base64(body.mask, "mask") if isinstance(body.mask, str) else None
    mask_grid = body.mask if isinstance(body.mask, list) else None
    return ImageInput(body, png, body.pixels, mask_png, mask_grid)


async def _from_form(request: Request) -> ImageInput:
    try:
        form = await request.form()
    except StarletteHTTPException as exc:  # Starlette's multipart parser: a bad boundary, a part without a name
        raise APIError(
            400,
            f"the multipart body cannot be read: {exc.detail}; send multipart/form-data with the "
            "boundary its Content-Type names and an `image` file part",
            None,
            "invalid_multipart",
        ) from None
    repeated = [name for name in FILE_FIELDS if len(form.getlist(name)) > 1]
    if repeated:
        raise invalid_request(
            f"the form has {len(form.getlist(repeated[0]))} `{repeated[0]}` parts; give at most one", repeated[0]
        )
    scalars = {k: v for k, v in form.multi_items() if k not in FILE_FIELDS}
    try:
        options = ImageOptions.model_validate({k: v for k, v in scalars.items() if v != ""}, strict=False)
    except ValidationError as exc:
        raise_validation(exc)
    # An empty form field is an absent one, as for the options above.
    image, mask, pixels = (form.get(name) or None for name in FILE_FIELDS)
    if (image is None) == (pixels is None):
        raise invalid_request(
            "give the digit as exactly one of an `image` file (PNG) or a `pixels` field (JSON, 28x28 grey levels)",
            "image",
        )
    return _form_input(options, image, mask, pixels, await _read_files(image, mask))


async def _read_files(*parts: Any) -> dict[int, bytes]:
    return {id(p): await p.read() for p in parts if isinstance(p, UploadFile)}


def _form_input(options: ImageOptions, image: Any, mask: Any, pixels: Any, files: dict[int, bytes]) -> ImageInput:
    png = (
        files[id(image)]
        if isinstance(image, UploadFile)
        else (imaging.decode_base64(image, "image") if image is not None else None)
    )
    grid = _json_grid(pixels, "pixels") if pixels is not None else None
    given = ImageInput(options, png, grid)
    if isinstance(mask, UploadFile):
        given.mask_png = files[id(mask)]
    elif isinstance(mask, str) and mask.lstrip().startswith("["):
        given.mask_grid = _json_grid(mask, "mask")
    elif isinstance(mask, str) and mask:
        given.mask_png = imaging.decode_base64(mask, "mask")
    return given


def _json_grid(text: Any, param: str) -> Grid:
    try:
        return TypeAdapter(Grid).validate_json(text)
    except ValidationError:
        raise ImageError(f"{param} must be JSON: 28 lists of 28 integers", param) from None


async def row_events(job: ImageJob, stream: GenerationStream) -> AsyncIterator[str]:
    """Rows of each completion as they are fixed, one event per finished image, then usage.

    With one particle a row is final as soon as its last pixel is drawn. With several, resampling
    may replace any pixel until the end: progress events say how far the particles have got, and
    each completion's rows follow once its particles have finished."""
    async for event in stream:
        if isinstance(event, Progress):
            if event.position % SIDE == SIDE - 1:
                yield sse({"object": "image.completion.progress", "rows_drawn": event.position // SIDE + 1})
            continue
        for payload in _fixed_rows(job, event):
            yield sse(payload)
        if event.finish_reason is not None:
            job.finished(event.sample, event.particles, event.cached_tokens)
            entry = job.entry(event.sample)
            entry.pop("pixels")
            yield sse({"object": "image.completion", **entry})
    job.record()
    yield sse({"object": "image.completion.usage", "id": job.id, "model": job.engine.name, "usage": job.usage()})


def _fixed_rows(job: ImageJob, event: Generation | SampleResult) -> list[dict[str, Any]]:
    """Row events for rows an event completes: one pixel's row, or every row of a whole sample."""
    if isinstance(event, SampleResult):
        job.canvases.fill(event)
        rows = job.canvases.rows_after(event)
    else:
        row = job.canvases.add(event)
        rows = [] if row is None else [row]
    return [
        {
            "object": "image.completion.row",
            "index": event.sample,
            "row": r,
            "pixels": job.canvases.image(event.sample)[r].tolist(),
        }
        for r in rows
    ]
