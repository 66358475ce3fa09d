"""The stream layer: what the engine thread hands to asyncio, and how.

`GenerationStream` is what `Engine.submit` returns. The engine thread puts
lists of events on it through `deliver`, one hand-over per event sink per
step: a `LoopSink` hops to an event loop of this process, and an engine
process's `PipeSink` (server/engine/process.py) sends them to the HTTP process,
whose `EngineClient` hands them to its loop. The handler iterates the
stream. A streamed request gets a Generation per token; a non-streamed one
gets its SampleResults together, once every sample has finished.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Protocol

from server.engine.types import Generation, GenerationError, GenerationRequest, Progress, PromptScores, SampleResult


ENGINE_ERROR, SHUTTING_DOWN, ENGINE_RESTARTING = "engine_error", "shutting_down", "engine_restarting"


class EngineFailure(RuntimeError):
    """The engine failed while running a request. `code` says why, for the client: `engine_error` (a fault),
    `shutting_down` (the server is draining), `engine_restarting` (the engine died and is coming back)."""

    def __init__(self, message: str, code: str = ENGINE_ERROR):
        super().__init__(message)
        self.code = code


class _EndOfStream:
    """The end-of-stream marker: unpickled in another process, it is still the one `DONE`."""

    def __reduce__(self) -> str:
        return "DONE"

    def __repr__(self) -> str:
        return "DONE"


DONE = _EndOfStream()

Event = Generation | SampleResult | Progress | GenerationError | _EndOfStream  # what a stream hands its reader


def is_terminal(item: object) -> bool:
    return item is DONE or isinstance(item, GenerationError)


class EventSink(Protocol):
    """Where the engine thread hands a step's events: an event loop, or the pipe to another process."""

    def put_events(self, batch: list[tuple[EventTarget, list[Event]]]) -> None: ...


class EventTarget(Protocol):
    """What events are handed to: a GenerationStream (or, in the HTTP process, an engine process's stream)."""

    @property
    def sink(self) -> EventSink: ...

    def release(self, items: list[Event]) -> list[Event]: ...


@dataclass(frozen=True)
class LoopSink:
    """Hands events to the streams' queues on `loop` (one thread hop per batch). Equal for one loop,
    so `deliver` groups every stream of a loop into one hop."""

    loop: asyncio.AbstractEventLoop

    def put_events(self, batch: list[tuple[EventTarget, list[Event]]]) -> None:
        call_in_loop(self.loop, _put_all, batch)


class GenerationStream:
    """One request's events; `cancel()` (on disconnect) frees its rows at the engine's next step."""

    def __init__(self, request: GenerationRequest, sink: EventSink, each_event: bool = True):
        self.request = request
        self.sink = sink
        # Lists of events, one list per hand-over: a whole image is one put and one get, not 785.
        self.queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        # False: the handler only wants the whole answer, so results are held until the end.
        self.each_event = each_event
        self._held: list[Event] = []  # engine thread only
        self.cancelled = False
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.cached_tokens = 0  # (engine thread) prompt tokens its prefill took from the prefix cache

    def cancel(self) -> None:
        self.cancelled = True

    def release(self, items: list[Event]) -> list[Event]:
        """(Engine thread.) What to hand over now: everything when streaming, else nothing until the end."""
        if self.each_event:
            return items
        self._held.extend(items)
        if not self._held or not is_terminal(self._held[-1]):
            return []
        ready, self._held = self._held, []
        return ready

    def __aiter__(self) -> AsyncIterator[Generation | SampleResult | Progress]:
        return self._events()

    async def _events(self) -> AsyncIterator[Generation | SampleResult | Progress]:
        while True:
            for item in await self.queue.get():
                if item is DONE:
                    return
                if isinstance(item, GenerationError):
                    raise EngineFailure(item.message, item.code)
                assert not isinstance(item, _EndOfStream)  # DONE is the one end-of-stream marker
                yield item


Outbox = dict[EventTarget, list[Event]]


def deliver(outbox: Outbox) -> None:
    """Hand events to their streams' sinks: one hand-over per sink."""
    hand_over(released(outbox))


def released(outbox: Outbox) -> list[tuple[EventTarget, list[Event]]]:
    """(Engine thread.) What each stream hands over now (see `GenerationStream.release`); streams with nothing left out."""
    return [(stream, ready) for stream, items in outbox.items() if (ready := stream.release(items))]


def hand_over(pairs: list[tuple[EventTarget, list[Event]]]) -> None:
    """Put each stream's released events on its sink, grouped: one hand-over per sink."""
    by_sink: dict[EventSink, list[tuple[EventTarget, list[Event]]]] = defaultdict(list)
    for stream, items in pairs:
        by_sink[stream.sink].append((stream, items))
    for sink, batch in by_sink.items():
        sink.put_events(batch)


def finish(streams: Iterable[GenerationStream], message: str | None = None, code: str = ENGINE_ERROR) -> None:
    """End streams: cleanly (message None) or with an error (`code`: see EngineFailure)."""
    outbox: Outbox = {
        s: [DONE if message is None else GenerationError(s.request.request_id, message, code)] for s in streams
    }
    deliver(outbox)


ScoreReply = Callable[[PromptScores | None, Exception | None], None]  # (result, error): called on the engine thread


@dataclass
class ScoreJob:
    """A prompt to score on the engine thread; `reply` takes its result (or error) back to the caller."""

    tokens: list[int]
    top: int
    reply: ScoreReply

    def resolve(self, result: PromptScores | None = None, error: Exception | None = None) -> None:
        """(Engine thread.) Hand over the result, or the error."""
        self.reply(result, error)


def reply_in_loop(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> ScoreReply:
    """A reply that settles `future` on its event loop."""
    return lambda result, error: call_in_loop(loop, settle, future, result, error)


def settle(future: asyncio.Future[Any], result: object, error: Exception | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def call_in_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody is listening
        pass


def _put_all(batch: list[tuple[EventTarget, list[Event]]]) -> None:
    for stream, items in batch:
        assert isinstance(stream, GenerationStream)  # an event loop's sink serves the streams of that loop
        stream.queue.put_nowait(items)
