"""Response shapes for the OpenAPI document: the error body and each route's statuses and content types.

Every route lists every status it can answer with, so the document a client
(or a schema fuzzer) reads matches what the server sends.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every 4xx and 5xx answer has it."""

    error: ErrorDetail


WHEN = {
    400: "the request is invalid: the message says which field and what is expected",
    401: "--api-key is set and the request lacks `Authorization: Bearer KEY`",
    404: "no such model or route",
    406: "the Accept header allows none of the types the route answers with",
    408: "the request body did not arrive in time",
    413: "the body is larger than --max-body-bytes",
    415: "the content type is not one this route reads",
    429: "the model's queue is full (--max-waiting); retry after Retry-After seconds",
    500: "the server failed the request",
    503: "the model is not ready or the server is shutting down",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": WHEN[status]} for status in statuses}


GENERATION_ERRORS = errors(400, 401, 404, 406, 413, 415, 429, 500, 503)
# Each server-sent event: `data:` holds one JSON chunk; the last event's data is [DONE].
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "one JSON chunk, or [DONE] to end the stream"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}

COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion (JSON), or with `stream: true` server-sent events", "content": SSE},
    **GENERATION_ERRORS,
}
