"""A completion streamed: its choices as server-sent events, chunk by chunk as their text becomes safe to show."""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from server.api.completion_response import TextCompletion
from server.api.engine_calls import merged_events
from server.api.sse import SSE_HEADERS, sse, sse_stream
from server.engine.base import EngineHandle
from server.engine.streams import GenerationStream


def streamed_answer(
    request: Request, engine: EngineHandle, completion: TextCompletion, streams: list[GenerationStream]
) -> StreamingResponse:
    return StreamingResponse(
        sse_stream(request, stream_events(completion, streams, engine), streams),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


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
        completion.end_without_generating()
        for choice in completion.final_choices():
            yield sse(completion.envelope([choice]))
    engine.metrics.request_latency(time.monotonic() - completion.started)
    if completion.body.stream_options and completion.body.stream_options.include_usage:
        yield sse({**completion.envelope([]), "usage": completion.usage()})
