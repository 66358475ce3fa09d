"""Prefix-aware routing under Ray Serve: a front deployment that reads each request's prompt and a request
router that sends it to the replica holding that prompt's prefix.

Serve's HTTP proxy routes on the path and headers alone (the body streams to
the replica only after routing), so with prefix routing on the application's
HTTP ingress is `PrefixRoutingFront`: it reads the body, takes its routing key
(prefix_routing.py) and forwards the request through a deployment handle to a
model replica's `forward`, which runs the replica's own app on it and streams
its ASGI messages back. That handle's router, `PrefixAffinityRouter`, ranks the
replicas by the key (Serve's request-router API: within a rank Serve takes the
least busy replica with room, and goes to the next rank when the first has
none).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message

from server.rayserve.prefix_routing import preference, routing_key

KEY_ARGUMENT = "routing_key"
# The parts of the front's ASGI scope a replica's app needs to answer the request as if it came first-hand.
FORWARDED_SCOPE = tuple("http_version method scheme path raw_path query_string headers client server".split())


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas by the request's routing key; an overloaded key replica yields to the least busy one."""

    def initialize_state(self, imbalance: int = 8) -> None:
        self.imbalance = imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get(KEY_ARGUMENT) if pending_request is not None else None
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        ranks = preference(key, sorted(by_id), self._queued(candidate_replicas), self.imbalance)
        return [[by_id[unique_id] for unique_id in rank] for rank in ranks]

    def _queued(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests each replica is known to hold (Serve's cache of their queue lengths; stale ones left out)."""
        cache = self._replica_queue_len_cache
        lengths = {r.replica_id.unique_id: cache.get(r.replica_id) for r in replicas}
        return {unique_id: length for unique_id, length in lengths.items() if length is not None}


class PrefixRoutingFront:
    """The HTTP ingress with prefix routing on: every request to a model replica through the router."""

    async def __init__(self, models: Any, prefix_chars: int):
        self.models = models.options(stream=True)  # a DeploymentHandle of the model deployment
        self.prefix_chars = prefix_chars
        # Serve routes HTTP here once the front runs: not before a model replica answers, or a request meanwhile
        # (a probe of /health) would wait for one instead of getting the replica's own 503 `starting`.
        await models.alive.remote()

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        scope = {name: request.scope[name] for name in FORWARDED_SCOPE if name in request.scope}
        key = routing_key(request.url.path, body, self.prefix_chars)
        messages = self.models.forward.remote(scope, body, **{KEY_ARGUMENT: key})
        start = await messages.__anext__()  # http.response.start: the status and headers
        response = StreamingResponse(bodies(messages), status_code=start["status"])
        response.raw_headers = list(start.get("headers", []))  # as the replica sent them, repeats included
        return response


async def bodies(messages: Any):
    """The body parts of a forwarded response, as the replica sends them (a stream stays a stream). A client
    that goes away cancels the replica's call, whose app then hears of the disconnect (`asgi_messages`)."""
    finished = False
    try:
        async for message in messages:
            if message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
        finished = True
    finally:
        if not finished:
            messages.cancel()


async def asgi_messages(app: ASGIApp, scope: dict, body: bytes):
    """Run `app` on one forwarded request (its whole body at hand); yield what it sends.

    If the caller stops listening (the client went away), the app is told the client disconnected, as a
    server would tell it, and stopped."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    parts = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if parts:
            return parts.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app({**scope, "type": "http", "asgi": {"version": "3.0"}, "root_path": ""}, receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
        await task  # the app's own failure, if it had one
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
