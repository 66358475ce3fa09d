"""Content negotiation: which of a route's representations a request's Accept header allows.

A client that asks for a type the route cannot send gets a 406 that lists what it
can, rather than a 200 in a type it did not ask for. OpenAI's clients send
`Accept: application/json` even when they stream, so the streaming routes take it
as a request for their server-sent events too.
"""

from __future__ import annotations

from fastapi import Request

from server.api.errors import APIError


def media_ranges(accept: str | None) -> list[str]:
    """The media ranges Accept lists, without those of quality 0; no header means anything (*/*)."""
    ranges = []
    for part in (accept or "*/*").split(","):
        kind, *params = [p.strip().lower() for p in part.split(";")]
        if kind and not any(refused(p) for p in params):
            ranges.append(kind)
    return ranges


def refused(param: str) -> bool:
    """Whether a media range's parameter is a quality of 0 ("q=0", "q=0.000"): the client refuses that type."""
    name, _, value = param.replace(" ", "").partition("=")
    try:
        return name == "q" and float(value) == 0
    except ValueError:
        return False


def allows(ranges: list[str], media_type: str) -> bool:
    kind = media_type.split("/")[0]
    return any(r in ("*/*", f"{kind}/*", media_type) for r in ranges)


def choose(accept: str | None, offered: list[str], stream: bool = False) -> str:
    """The first of `offered` (the route's order of preference) that Accept allows; a 406 naming them if none."""
    ranges = media_ranges(accept)
    chosen = next((media_type for media_type in offered if allows(ranges, media_type)), None)
    if chosen is None:
        how = " with stream=true" if stream else ""
        raise APIError(
            406,
            f"this endpoint answers{how} with {' or '.join(offered)}; Accept: {accept} allows none of them",
            None,
            "not_acceptable",
        )
    return chosen


def stream_type(accept: str | None) -> str:
    """A streaming answer: server-sent events, also for clients that accept only JSON (see above)."""
    return choose(accept, ["text/event-stream", "application/json"], stream=True)


def check_accept(request: Request, stream: bool) -> None:
    """A 406 before any work when the Accept header allows neither JSON nor, streamed, server-sent events."""
    accept = request.headers.get("accept")
    stream_type(accept) if stream else choose(accept, ["application/json"])
