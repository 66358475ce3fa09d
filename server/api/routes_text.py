"""POST /v1/completions: OpenAI-compatible text completion, over bytes or a model's own tokenizer; POST /tokenize
and /detokenize: its tokens for a text and back.

Each prompt of a request is one engine request of `best_of` (else `n`)
samples; their events are merged in arrival order when streaming.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from server.api.deps import ServerState, get_server
from server.engine.base import EngineHandle
from server.engine.streams import GenerationStream
from server.api.responses import COMPLETION_RESPONSES
from server.api.negotiation import choose, stream_type
from server.api.generation import (
    SSE_HEADERS,
    ClientGone,
    collect_all,
    engine_refusals,
    merged_events,
    score,
    sse,
    sse_stream,
    submit,
)
from server.api.errors import invalid_request, utf8_body
from server.api.responses import errors
from server.api.text_api import CompletionRequest, CompletionResponse, TextCompletion
from server.api.tokenize_api import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.engine.types import GenerationRequest, PromptScores
from server.engine.validation import check_logit_bias

router = APIRouter(dependencies=[Depends(utf8_body)])


@router.post("/v1/completions", response_model=CompletionResponse, responses=COMPLETION_RESPONSES)
async def create_completion(
    body: CompletionRequest, request: Request, server: ServerState = Depends(get_server)
) -> Response | dict[str, Any]:
    server.label_model(request, body.model)
    check_accept(request, body.stream)
    engine = server.engine_for(request, body.model, "text")
    with engine_refusals(engine):
        check_logit_bias(body.bias(), engine.name, engine.config.vocab_size)
    completion = TextCompletion(body, engine.name, f"cmpl-{uuid.uuid4().hex}", engine.vocabulary)
    return await answer(request, engine, completion, body.prompts(engine.vocabulary))


def check_accept(request: Request, stream: bool) -> None:
    """A 406 before any work when the Accept header allows neither JSON nor, streamed, server-sent events."""
    accept = request.headers.get("accept")
    stream_type(accept) if stream else choose(accept, ["application/json"])


async def answer(
    request: Request, engine: EngineHandle, completion: TextCompletion, prompts: list[list[int]]
) -> Response | dict[str, Any]:
    """Generate `completion`'s samples of each prompt and answer with them: whole, or streamed as they come
    (the text and chat endpoints alike; `completion` shapes the choices)."""
    body = completion.body
    streams = await start_generations(engine, body, prompts, completion)
    try:
        for prompt in prompts:
            completion.add_prompt(prompt, await prompt_scores(engine, body, prompt))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    if body.stream:
        return StreamingResponse(
            sse_stream(request, stream_events(completion, streams, engine), streams),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    try:
        results = await collect_all(request, streams)
    except ClientGone:
        request.state.outcome = "cancelled"
        return Response(status_code=499)
    for part, samples in enumerate(results):
        for result in samples:
            completion.add_result(part, result)
    finish_without_generating(completion)
    engine.metrics.request_latency(time.monotonic() - completion.started)
    return {**completion.envelope(completion.final_choices()), "usage": completion.usage()}


async def start_generations(
    engine: EngineHandle, body: CompletionRequest, prompts: list[list[int]], completion: TextCompletion
) -> list[GenerationStream]:
    """Queue one generation per prompt (the engine validates each); none when max_tokens is 0,
    but each prompt must still fit. A refusal cancels those already queued."""
    streams: list[GenerationStream] = []
    try:
        for i, prompt in enumerate(prompts):
            if body.max_tokens == 0:
                with engine_refusals(engine):
                    engine.check_prompt(prompt, body.samples)
            else:
                streams.append(
                    await submit(engine, generation_request(body, prompt, f"{completion.id}-{i}"), body.stream)
                )
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


def generation_request(body: CompletionRequest, prompt: list[int], request_id: str) -> GenerationRequest:
    sampling = body.sampling(
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, logit_bias=body.bias()
    )
    ranks = body.samples > body.n  # best_of ranks samples by their log-probabilities
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        max_new_tokens=body.max_tokens,
        sampling=sampling,
        n=body.samples,
        stop=body.stop_bytes(),
        logprobs=body.logprobs is not None or ranks,
        top_logprobs=body.logprobs or 0,
    )


async def prompt_scores(engine: EngineHandle, body: CompletionRequest, prompt: list[int]) -> PromptScores | None:
    """The prompt's log-probabilities (and top alternatives) when echoed with logprobs, else none."""
    if body.echo and body.logprobs is not None and prompt:
        return await score(engine, prompt, body.logprobs)
    return None


def finish_without_generating(completion: TextCompletion) -> None:
    """max_tokens 0: every sample ends at once, by length."""
    if completion.body.max_tokens == 0:
        for part in completion.parts:
            part.finish = ["length"] * len(part.finish)


async def stream_events(
    completion: TextCompletion, streams: list[GenerationStream], engine: EngineHandle
) -> AsyncIterator[str]:
    """SSE chunks as text becomes safe to show, then usage (if asked)."""
    for choice in completion.opening_choices():
        yield sse(completion.envelope([choice]))
    if streams:
        async for part, event in merged_events(streams):
            completion.add(part, event)
            chunk = completion.parts[part].texts[event.sample].take(final=event.finish_reason is not None)
            if chunk.text or chunk.tokens or event.finish_reason:
                index = completion.index(part, event.sample)
                yield sse(completion.envelope([completion.choice(index, part, event.sample, chunk)]))
    else:
        finish_without_generating(completion)
        for choice in completion.final_choices():
            yield sse(completion.envelope([choice]))
    engine.metrics.request_latency(time.monotonic() - completion.started)
    if completion.body.stream_options and completion.body.stream_options.include_usage:
        yield sse({**completion.envelope([]), "usage": completion.usage()})


@router.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 401, 404, 413, 415))
async def tokenize(body: TokenizeRequest, request: Request, server: ServerState = Depends(get_server)) -> dict:
    engine = server.engine_for(request, body.model, "text")
    vocabulary = engine.vocabulary
    tokens = vocabulary.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {
        "count": len(tokens),
        "max_model_len": engine.config.max_len,
        "tokens": tokens,
        "token_strs": [vocabulary.shown[t] for t in tokens] if body.return_token_strs else None,
    }


@router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 401, 404, 413, 415))
async def detokenize(body: DetokenizeRequest, request: Request, server: ServerState = Depends(get_server)) -> dict:
    engine = server.engine_for(request, body.model, "text")
    size = engine.vocabulary.size
    bad = next((t for t in body.tokens if t >= size), None)
    if bad is not None:
        raise invalid_request(f"tokens holds {bad}; model '{engine.name}' has tokens 0..{size - 1}", "tokens")
    return {"prompt": engine.vocabulary.decode(body.tokens)}
