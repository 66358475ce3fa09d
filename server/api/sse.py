"""Server-sent events: a payload as an event, and the framing of a streamed answer (errors in-band after the
status line, the generation cancelled when the client leaves, always ending with [DONE])."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import Request

from server.api.engine_calls import engine_error
from server.api.errors import error_body
from server.engine.streams import EngineFailure, GenerationStream

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer events
DONE_EVENT = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_error(exc: Exception) -> str:
    """An error after the stream started: the status is already sent, so it goes in an event."""
    if isinstance(exc, EngineFailure):
        err = engine_error(exc)
        return sse(error_body(err.status, err.message, None, err.code))
    return sse(error_body(500, f"internal server error ({type(exc).__name__})", None, "internal_error"))


async def sse_stream(
    request: Request, chunks: AsyncIterator[str], streams: list[GenerationStream]
) -> AsyncIterator[str]:
    """Frame a handler's SSE chunks: an error after the status line goes in-band, the generation
    is cancelled if the client leaves (its slots are freed), and the stream always ends with [DONE]."""
    finished = False
    try:
        async for chunk in chunks:
            yield chunk
        finished = True
    except Exception as exc:  # the status line is gone: report in-band
        request.state.outcome = "error"
        yield sse_error(exc)
        finished = True
    finally:
        for stream in streams:
            stream.cancel()
        if not finished:
            request.state.outcome = "cancelled"
    yield DONE_EVENT
