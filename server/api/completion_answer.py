"""Answering a completion (text or chat alike; the `TextCompletion` given shapes the choices): generate the
samples of each prompt, then stream them as they come or answer with them whole."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.api.completion_generations import prompt_scores, start_generations
from server.api.completion_response import TextCompletion
from server.api.completion_stream import streamed_answer
from server.api.engine_calls import ClientGone, collect_all
from server.engine.base import EngineHandle
from server.engine.streams import GenerationStream


async def answer(
    request: Request, engine: EngineHandle, completion: TextCompletion, prompts: list[list[int]]
) -> Response | dict[str, Any]:
    """Generate `completion`'s samples of each prompt and answer with them: whole, or streamed as they come."""
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
        return streamed_answer(request, engine, completion, streams)
    return await whole_answer(request, engine, completion, streams)


async def whole_answer(
    request: Request, engine: EngineHandle, completion: TextCompletion, streams: list[GenerationStream]
) -> Response | dict[str, Any]:
    """Every sample once all have ended, as one JSON answer with usage; a 499 if the client left first."""
    try:
        results = await collect_all(request, streams)
    except ClientGone:
        request.state.outcome = "cancelled"
        return Response(status_code=499)
    for part, samples in enumerate(results):
        for result in samples:
            completion.add_result(part, result)
    completion.end_without_generating()
    engine.metrics.request_latency(time.monotonic() - completion.started)
    return {**completion.envelope(completion.final_choices()), "usage": completion.usage()}
