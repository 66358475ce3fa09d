"""The stream layer: what the engine thread hands to asyncio, and how.

`GenerationStream` is what `Engine.submit` returns. The engine thread puts
lists of events on it through `deliver`, one thread hop per event loop per
step; the handler iterates it. A streamed request gets a Generation per
token; a non-streamed one gets its SampleResults together, once every
sample has finished.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import AsyncIterator

from .types import Generation, GenerationError, GenerationRequest, SampleResult


class EngineFailure(RuntimeError):
    """The engine failed while running a request."""


DONE = object()  # end-of-stream marker


def _is_terminal(item) -> bool:
    return item is DONE or isinstance(item, GenerationError)


class GenerationStream:
    """One request's events; `cancel()` (on disconnect) frees its rows at the engine's next step."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None, each_event: bool = True):
        self.request = request
        self.loop = loop
        # Lists of events, one list per hand-over: a whole image is one put and one get, not 785.
        self.queue: asyncio.Queue[list] = asyncio.Queue()
        # False: the handler only wants the whole answer, so results are held until the end.
        self.each_event = each_event
        self._held: list = []  # engine thread only
        self.cancelled = False
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def release(self, items: list) -> list:
        """(Engine thread.) What to hand over now: everything when streaming, else nothing until the end."""
        if self.each_event:
            return items
        self._held.extend(items)
        if not self._held or not _is_terminal(self._held[-1]):
            return []
        ready, self._held = self._held, []
        return ready

    def __aiter__(self):
        return self._events()

    async def _events(self) -> AsyncIterator[Generation | SampleResult]:
        while True:
            for item in await self.queue.get():
                if item is DONE:
                    return
                if isinstance(item, GenerationError):
                    raise EngineFailure(item.message)
                yield item


Outbox = dict[GenerationStream, list]


def deliver(outbox: Outbox) -> None:
    """Hand events to their streams' event loops: one thread hop per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for stream, items in outbox.items():
        ready = stream.release(items)
        if ready:
            by_loop[stream.loop].append((stream, ready))
    for loop, batch in by_loop.items():
        call_in_loop(loop, _put_all, batch)


def finish(streams, message: str | None = None) -> None:
    """End streams: cleanly (message None) or with an error."""
    deliver({s: [DONE if message is None else GenerationError(s.request.request_id, message)] for s in streams})


@dataclass
class ScoreJob:
    """A prompt to score on the engine thread; its result goes back to the caller's event loop."""

    tokens: list[int]
    top: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def resolve(self, result=None, error: Exception | None = None) -> None:
        """(Engine thread.) Hand over the result, or the error."""
        call_in_loop(self.loop, _settle, self.future, result, error)


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def call_in_loop(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody is listening
        pass


def _put_all(batch: list[tuple[GenerationStream, list]]) -> None:
    for stream, items in batch:
        stream.queue.put_nowait(items)
