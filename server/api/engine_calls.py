"""What the generation handlers (text, chat, images) share to call an engine: its refusals as HTTP errors,
submitting and scoring, and waiting for the results while watching for the client leaving."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import AsyncIterator, Iterator

from fastapi import Request

from server.engine.base import EngineHandle
from server.engine.scheduler import QueueFull
from server.engine.streams import EngineFailure, GenerationStream
from server.engine.streams import ENGINE_ERROR, ENGINE_RESTARTING
from server.api.errors import APIError, invalid_request
from server.engine.types import Generation, GenerationRequest, PromptScores, SampleResult
from server.engine.validation import InvalidRequest


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@contextmanager
def engine_refusals(engine: EngineHandle) -> Iterator[None]:
    """Turn an engine's refusals into 503 (not ready) / 429 (queue full) / 400 (bad request) answers."""
    if not engine.ready:  # a stopped engine would never answer
        retry = {"Retry-After": str(engine.retry_after_seconds())}
        raise APIError(503, f"model '{engine.name}' is not ready; see GET /health", "model", "not_ready", retry)
    try:
        yield
    except QueueFull as exc:
        raise APIError(
            429,
            f"{exc} (the server queues at most --max-waiting requests per model and engine worker)",
            None,
            "queue_full",
            {"Retry-After": "1"},
        ) from None
    except InvalidRequest as exc:
        raise invalid_request(str(exc), exc.param, exc.code) from None
    except EngineFailure as exc:  # e.g. a score waiting when the engine shut down
        raise engine_error(exc) from None


async def submit(engine: EngineHandle, request: GenerationRequest, each_event: bool = True) -> GenerationStream:
    """Queue a request; each_event=False (a non-streamed answer) gets its events only at the end."""
    with engine_refusals(engine):
        return await engine.enqueue(request, each_event)


async def score(engine: EngineHandle, tokens: list[int], top: int = 0) -> PromptScores:
    """Log-probabilities of a prompt in one parallel pass, bounded like generation requests."""
    with engine_refusals(engine):
        return await engine.score(tokens, top)


async def collect(request: Request, stream: GenerationStream) -> list[SampleResult]:
    """The samples of a non-streamed request (see collect_all)."""
    return (await collect_all(request, [stream]))[0]


async def collect_all(request: Request, streams: list[GenerationStream]) -> list[list[SampleResult]]:
    """The samples of each stream of a non-streamed request. If the client leaves first the
    requests are cancelled, so their slots are freed at the engine's next step."""
    consume = asyncio.ensure_future(asyncio.gather(*(_all_events(s) for s in streams)))
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
        if consume in done:
            return consume.result()
        raise ClientGone()
    except EngineFailure as exc:
        raise engine_error(exc) from None
    finally:
        watch.cancel()
        cancel_quietly(consume)
        for stream in streams:
            stream.cancel()  # no-op once finished; frees slots otherwise


def cancel_quietly(future: asyncio.Future) -> None:
    """Cancel `future` and take its outcome when it ends: a cancelled gather ends with a CancelledError as its
    exception, which asyncio would otherwise log as never retrieved (for every client that left)."""
    future.cancel()
    future.add_done_callback(lambda done: done.cancelled() or done.exception())


async def _all_events(stream: GenerationStream) -> list[SampleResult]:
    return [event async for event in stream]


async def merged_events(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, Generation]]:
    """(stream index, event) from several streams, in arrival order; one stream is read directly."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: GenerationStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((i, event, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # re-raised in the reader
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while (item := await queue.get())[1] is not None:
                yield item[0], item[1]
            if item[2] is not None:
                raise item[2]
    finally:
        for task in tasks:
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def engine_error(exc: EngineFailure) -> APIError:
    """503 for a server that is draining or an engine coming back (retry later, or elsewhere); 500 for a fault."""
    status = 500 if exc.code == ENGINE_ERROR else 503
    headers = {"Retry-After": "1"} if exc.code == ENGINE_RESTARTING else None
    return APIError(status, f"generation failed: {exc}", None, exc.code, headers)
