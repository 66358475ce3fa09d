"""Graceful drain: refuse new work, let requests in flight finish, then stop.

The same standalone (`DrainingServer` below, on SIGTERM) and under Ray Serve
(`ray_app`, when a replica is stopped):
 1. `Drain.begin()`: /health answers 503 at once, every new request a JSON 503, but /metrics answers on, so
    that a Prometheus scrape still gets the last figures;
 2. requests in flight get up to --drain-seconds to finish;
 3. past it the engines stop, so what still runs ends with "server is shutting
    down": a JSON 503, or on a stream an SSE error event and then [DONE];
 4. the caller exits (status 0).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterable

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.errors import error_response

if TYPE_CHECKING:
    from server.engine.base import EngineHandle

log = logging.getLogger("rnnserve.drain")
POLL_SECONDS = 0.05
ANSWER_SECONDS = 5.0  # after the engines stop, failed requests get this long to send their error answers
SHUTTING_DOWN = "server is shutting down"
ANSWERED_WHILE_DRAINING = frozenset({"/metrics"})  # read-only, quick, and wanted to the end


class Drain:
    """Whether the server is draining, and how many requests are in flight (event-loop side)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started: float | None = None
        self.in_flight = 0

    @property
    def draining(self) -> bool:
        return self.started is not None

    def begin(self) -> None:
        if self.started is None:
            self.started = time.monotonic()
            log.info("draining: %d request(s) in flight get up to %g s to finish", self.in_flight, self.seconds)

    async def run(self, engines: Iterable["EngineHandle"]) -> bool:
        """Drain to the end: True if every request in flight finished before the deadline."""
        self.begin()
        finished = await self._wait_idle(self.started + self.seconds)
        if not finished:
            log.warning(
                "drain deadline (%g s) passed with %d request(s) in flight; ending them", self.seconds, self.in_flight
            )
        # Stopping an engine fails what it still holds with SHUTTING_DOWN (Engine._fail_all).
        await asyncio.to_thread(_stop_all, list(engines))
        if not await self._wait_idle(time.monotonic() + ANSWER_SECONDS):
            log.warning("%d request(s) still open after the engines stopped", self.in_flight)
        return finished

    async def _wait_idle(self, deadline: float) -> bool:
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        return self.in_flight == 0


def _stop_all(engines: list["EngineHandle"]) -> None:
    """Stop every engine at once: each engine process exits on its own, so waiting for them one by one
    would add their exit times up."""
    if not engines:
        return
    with ThreadPoolExecutor(len(engines), thread_name_prefix="stop") as pool:
        for stopped in [pool.submit(engine.stop) for engine in engines]:
            stopped.result()


async def drain_app(app) -> bool:
    """Drain an app built by `build_app` (its engines exist once its lifespan has started)."""
    server = getattr(app.state, "server", None)
    return await app.state.drain.run(server.engines if server is not None else [])


class DrainMiddleware:
    """Count requests in flight; while draining, answer new ones with a JSON 503 and close the connection."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] in ANSWERED_WHILE_DRAINING:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            scope.setdefault("state", {})["outcome"] = "draining"  # RequestMetricsMiddleware's label
            # Connection: close, so a client or load balancer moves its keep-alive connection elsewhere.
            response = error_response(
                503,
                f"{SHUTTING_DOWN}; retry once it is back (or on another replica)",
                None,
                "shutting_down",
                {"Connection": "close", "Retry-After": "1"},
            )
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn that drains its app on SIGTERM or Ctrl-C, then exits normally (status 0).

    uvicorn's own handler stops listening at once, cuts what is still running
    after its grace period, and re-raises the signal (exit 143). A second
    signal here stops at once.
    """

    _loop: asyncio.AbstractEventLoop | None = None
    _signalled = False
    _drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None or self._signalled or self.should_exit:
            self.should_exit = self.force_exit = True
            return
        self._signalled = True
        log.info("received %s", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain_app(self.config.app)
        finally:
            self.should_exit = True
