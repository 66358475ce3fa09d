"""Pure ASGI middleware: API key check, body size limit, request counting.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through
untouched and a client disconnect still reaches the handler.
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import error_response
from server.metrics import Metrics
from server.api.routes_playground import PAGE_PATHS, STATIC_PREFIX

# Probes, scrapers, the API's own documentation and the playground page need no key
# (the page asks for the key and sends it with its API calls).
OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", *PAGE_PATHS}
)
OPEN_PREFIXES = ("/static-offline-docs/", STATIC_PREFIX + "/")
TOO_LARGE = object()


class ApiKeyMiddleware:
    """Require `Authorization: Bearer KEY` everywhere but the open paths."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope.get("path", "")) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            "missing or wrong API key; send the header 'Authorization: Bearer YOUR_KEY'",
            None,
            "invalid_api_key",
            {"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # constant time: the key cannot be guessed byte by byte from response times
        return hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"


def is_open(path: str) -> bool:
    # a trailing slash only earns a redirect to the open path (Starlette's redirect_slashes)
    return (path.rstrip("/") or "/") in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class BodyLimitMiddleware:
    """Refuse bodies over `limit` bytes with 413, declared or streamed, and
    bodies that have not all arrived within `timeout` seconds with 408.

    The body is read here (bounded by the limit) and replayed to the app;
    after it, the app's receive() goes to the server again, so it still
    sees the client disconnect.
    """

    def __init__(self, app: ASGIApp, limit: int, timeout: float):
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send, int(declared))
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            await self._timed_out(scope, receive, send)
            return
        if body is TOO_LARGE:
            await self._too_large(scope, receive, send, None)
        elif body is not None:  # None: the client left while sending
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | object | None:
        """The whole body; TOO_LARGE once it passes the limit; None on disconnect."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return TOO_LARGE
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more than that"
        response = error_response(
            413,
            f"request body is {size}; the limit is {self.limit} bytes (--max-body-bytes)",
            None,
            "request_too_large",
        )
        await response(scope, receive, send)

    async def _timed_out(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})["outcome"] = "timeout"
        # Connection: close, so the server drops the half-sent request instead of waiting for the rest.
        response = error_response(
            408,
            f"the request body did not arrive within {self.timeout:g} s (--body-timeout)",
            None,
            "body_timeout",
            {"Connection": "close"},
        )
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class RequestMetricsMiddleware:
    """Count every request by endpoint (route template) and outcome.

    Handlers may name the outcome in `request.state.outcome` (e.g. a stream
    the client left, "cancelled"); otherwise it follows the status code. The
    model a request named comes from `request.state.model` and `.attention`.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, known_paths: set[str]):
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            state = scope.get("state", {})
            outcome = state.get("outcome") or outcome_of(status)
            self.metrics.request(
                self._endpoint(scope), outcome, state.get("model", "none"), state.get("attention", "none")
            )

    def _endpoint(self, scope: Scope) -> str:
        route = scope.get("route")
        path = getattr(route, "path", None) or scope["path"]
        return path if path in self.known_paths else "other"  # unknown paths: bounded label values


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    return {401: "unauthorized", 404: "not_found", 408: "timeout", 413: "too_large", 429: "rejected"}.get(
        status, "invalid" if status < 500 else "error"
    )
