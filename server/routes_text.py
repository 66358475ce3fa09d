"""POST /v1/completions: OpenAI-compatible text completion over byte tokens."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .deps import ServerState, get_server
from .engine import Engine, GenerationStream
from .schemas import SamplingOptions
from .streaming import SSE_HEADERS, ClientGone, collect, engine_refusals, score, sse, sse_stream, submit
from .textcodec import SampleText, TextChunk, token_text
from .types import Generation, GenerationRequest, SampleResult

router = APIRouter()
MAX_STOPS = 4
Byte = Annotated[int, Field(ge=0, le=255)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(SamplingOptions):
    model: str | None = Field(None, description="a text model from GET /v1/models; default: the best loaded one")
    prompt: str | list[Byte] = Field("", description="text (sent as UTF-8 bytes) or a list of byte tokens 0-255")
    max_tokens: int = Field(16, ge=0, description="bytes to generate; 0 with echo scores the prompt")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOPS} sequences that end a sample (not included)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5, description="return each token's log-probability (no top alternatives)")
    echo: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stop

    def stop_bytes(self) -> list[bytes]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s.encode("utf-8") for s in stops]

    def prompt_bytes(self) -> bytes:
        return self.prompt.encode("utf-8") if isinstance(self.prompt, str) else bytes(self.prompt)


@dataclass
class Completion:
    """One request's samples as they build up."""

    body: CompletionRequest
    engine: Engine
    prompt: bytes
    prompt_logprobs: list[float | None]
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    texts: list[SampleText] = field(init=False)
    finish: list[str | None] = field(init=False)
    generated_tokens: int = 0

    def __post_init__(self) -> None:
        prefix = self.prompt if self.body.echo else b""
        prefix_logprobs = self.prompt_logprobs if self.body.echo else []
        self.texts = [SampleText(self.body.stop_bytes(), prefix, prefix_logprobs) for _ in range(self.body.n)]
        self.finish = [None] * self.body.n

    def add(self, event: Generation) -> None:
        self.generated_tokens += 1
        self.texts[event.sample].push(event.token, event.logprob)
        if event.finish_reason:
            self._end(event.sample, event.finish_reason, event.matched_stop)

    def add_result(self, result: SampleResult) -> None:
        """A whole sample at once (non-streamed)."""
        text = self.texts[result.sample]
        for token, logprob in zip(result.tokens, result.logprobs or [None] * len(result.tokens)):
            text.push(token, logprob)
        self.generated_tokens += len(result.tokens)
        self._end(result.sample, result.finish_reason, result.matched_stop)

    def _end(self, sample: int, finish_reason: str, matched_stop: bytes | None) -> None:
        self.texts[sample].end(matched_stop)
        self.finish[sample] = finish_reason

    def choice(self, index: int, chunk: TextChunk) -> dict[str, Any]:
        return {"text": chunk.text, "index": index, "logprobs": self._logprobs(chunk), "finish_reason": self.finish[index]}

    def _logprobs(self, chunk: TextChunk) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        return {"tokens": [token_text(t) for t in chunk.tokens], "token_logprobs": chunk.logprobs,
                "top_logprobs": None, "text_offset": chunk.offsets}

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.engine.name,
                "choices": choices}

    def usage(self) -> dict[str, int]:
        prompt = len(self.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.generated_tokens,
                "total_tokens": prompt + self.generated_tokens}


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            server: ServerState = Depends(get_server)) -> Response | dict[str, Any]:
    engine = server.engines.for_request(request, body.model, "text")
    prompt, request_id = body.prompt_bytes(), f"cmpl-{uuid.uuid4().hex}"
    stream = start_generation(engine, body, prompt, request_id)
    try:
        completion = Completion(body, engine, prompt, await prompt_scores(engine, body, prompt), request_id)
    except BaseException:
        if stream is not None:
            stream.cancel()
        raise
    if body.stream:
        return StreamingResponse(sse_stream(request, stream_events(completion, stream), stream), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        results = await collect(request, stream) if stream is not None else []
    except ClientGone:
        request.state.outcome = "cancelled"
        return Response(status_code=499)
    for result in results:
        completion.add_result(result)
    finish_without_generating(completion)
    engine.metrics.request_latency(time.monotonic() - completion.started)
    choices = [completion.choice(i, text.take(final=True)) for i, text in enumerate(completion.texts)]
    return {**completion.envelope(choices), "usage": completion.usage()}


def start_generation(engine: Engine, body: CompletionRequest, prompt: bytes, request_id: str) -> GenerationStream | None:
    """Queue the generation (validated by the engine); max_tokens 0 generates nothing, but the prompt must fit."""
    if body.max_tokens == 0:
        with engine_refusals(engine):
            engine.check_prompt(list(prompt))
        return None
    request = GenerationRequest(request_id=request_id, prompt=list(prompt), max_new_tokens=body.max_tokens,
                                sampling=body.sampling(), n=body.n, stop=body.stop_bytes(),
                                logprobs=body.logprobs is not None)
    return submit(engine, request, each_event=body.stream)


async def prompt_scores(engine: Engine, body: CompletionRequest, prompt: bytes) -> list[float | None]:
    """The prompt's log-probabilities when echoed with logprobs, else none."""
    if body.echo and body.logprobs is not None and prompt:
        return list(await score(engine, list(prompt)))
    return []


def finish_without_generating(completion: Completion) -> None:
    """max_tokens 0: every sample ends at once, by length."""
    if completion.body.max_tokens == 0:
        completion.finish = ["length"] * completion.body.n


async def stream_events(completion: Completion, stream: GenerationStream | None) -> AsyncIterator[str]:
    """SSE chunks as text becomes safe to show, then usage (if asked)."""
    if completion.body.echo:
        for i, text in enumerate(completion.texts):
            yield sse(completion.envelope([completion.choice(i, text.take())]))
    if stream is not None:
        async for event in stream:
            completion.add(event)
            chunk = completion.texts[event.sample].take(final=event.finish_reason is not None)
            if chunk.text or chunk.tokens or event.finish_reason:
                yield sse(completion.envelope([completion.choice(event.sample, chunk)]))
    else:
        finish_without_generating(completion)
        for i, text in enumerate(completion.texts):
            yield sse(completion.envelope([completion.choice(i, text.take(final=True))]))
    completion.engine.metrics.request_latency(time.monotonic() - completion.started)
    if completion.body.stream_options and completion.body.stream_options.include_usage:
        yield sse({**completion.envelope([]), "usage": completion.usage()})
