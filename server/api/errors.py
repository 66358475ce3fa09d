"""OpenAI-style JSON errors for every 4xx/5xx the server sends.

Body: {"error": {"message", "type", "param", "code"}}. Handlers raise
`APIError`; validation errors, unknown routes, and anything unexpected are
turned into the same shape by the handlers installed with `install`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

# status -> OpenAI error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    406: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class FieldError(ValueError):
    """A request field's value is wrong: raised in schema validators, so the error names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """An error answer: status, a message saying what to fix, and the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def invalid_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    """JSON escaped to ASCII: an error may quote input holding lone surrogates, which UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return AsciiJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


MAX_ERRORS_SHOWN = 3  # per field: a 28x28 grid of bad pixels is one line, not 784
JSON_KINDS = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}
BODY_EXAMPLES = {
    "/v1/completions": '{"prompt": "Once upon a time", "max_tokens": 16}',
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "Hello"}]}',
    "/v1/images/completions": '{"image": "<base64 28x28 PNG>", "keep_rows": 14}',
}
JITER_DEPTH = 200  # pydantic's JSON parser (the image route's) refuses deeper nesting
NESTING_NEEDED = 3  # the deepest a valid body nests: {"prompt": [[1, 2]]}, {"pixels": [[0, ...], ...]}


def not_utf8(body: bytes) -> str | None:
    """Where a body stops being UTF-8, in words; None when it is UTF-8."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (
            f"the body is not UTF-8: byte 0x{body[exc.start]:02x} at offset {exc.start} ({exc.reason}); "
            "JSON bodies must be UTF-8 encoded"
        )
    if b"\x00" in body:  # UTF-8, but JSON in UTF-8 never holds a raw NUL: ASCII text in UTF-16 or UTF-32
        return (
            f"the body holds a NUL byte at offset {body.index(0)}: it looks UTF-16 or UTF-32 encoded; "
            "JSON bodies must be UTF-8 encoded"
        )
    return None


async def utf8_body(request: Request) -> None:
    """A route dependency: refuse a JSON body that is not UTF-8, which Python's JSON parser reads anyway (it
    detects UTF-16 and UTF-32), as JSON on the wire is UTF-8 (RFC 8259) and OpenAI's API reads nothing else."""
    problem = not_utf8(await request.body())
    if problem:
        raise APIError(400, problem, None, "invalid_json")


def media_type(content_type: str | None) -> str:
    """A Content-Type header's type and subtype, lower case, without parameters ("" for none)."""
    return (content_type or "").split(";")[0].strip().lower()


def is_json(content_type: str | None) -> bool:
    """application/json, or a type with JSON's suffix (RFC 6839): what FastAPI parses as JSON."""
    kind = media_type(content_type)
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def too_deep(limit: int | None) -> str:
    allows = f"the JSON parser allows ({limit} levels)" if limit else "the JSON parser allows"
    return f"the body nests arrays or objects deeper than {allows}; a request nests at most {NESTING_NEEDED}"


def empty_body(path: str) -> str:
    example = BODY_EXAMPLES.get(path)
    return "the request body is empty; send a JSON object" + (f" such as {example}" if example else "")


WHOLE_BODY_TYPES = ("model_type", "model_attributes_type", "dict_type")  # pydantic's "not an object" errors


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic errors -> ("field: what is wrong; ...", first field), folded per top-level field."""
    by_field: dict[str | None, list[str]] = {}
    for err in errors:
        param, text = _describe(err)
        by_field.setdefault(param, []).append(text)
    parts = []
    for param, texts in by_field.items():
        parts.extend(texts[:MAX_ERRORS_SHOWN])
        if len(texts) > MAX_ERRORS_SHOWN:
            parts.append(f"and {len(texts) - MAX_ERRORS_SHOWN} more errors in {param or 'the body'}")
    return "; ".join(parts) or "invalid request", next(iter(by_field), None)


def _describe(err: dict[str, Any]) -> tuple[str | None, str]:
    """One pydantic error -> (top-level field, "where: what is wrong (got ...)")."""
    if err.get("type") == "json_invalid":
        return _json_invalid(err)
    cause = (err.get("ctx") or {}).get("error")
    loc = _field_path(err)
    if not loc and err.get("type") in WHOLE_BODY_TYPES:
        return None, f"the body must be a JSON object of the request's fields, got {_json_kind(err.get('input'))}"
    param = getattr(cause, "param", None) or (str(loc[0]) if loc else None)
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or param or "body"
    if isinstance(cause, FieldError):  # its message names the field already
        return param, str(cause)
    got = err.get("input")
    if err.get("type") == "finite_number":
        return param, f"{where} must be a finite number, got {_short(got)}"
    message = err.get("msg", "invalid").removeprefix("Value error, ")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {_short(got)})"
    return param, f"{where}: {message}{shown}"


def _not_an_object(err: dict[str, Any]) -> bool:
    """Malformed JSON, or a body that is JSON but not an object (a request is one)."""
    return err.get("type") == "json_invalid" or (err.get("type") in WHOLE_BODY_TYPES and not _field_path(err))


def _field_path(err: dict[str, Any]) -> list:
    return [p for p in err.get("loc", ()) if p not in ("body", "query", "path")]


def _json_invalid(err: dict[str, Any]) -> tuple[str | None, str]:
    """A body the JSON parser refused: FastAPI's (`loc` has the character) or pydantic's (`input` is the body);
    (the field at fault if known, why)."""
    body = err.get("input")
    reason = (err.get("ctx") or {}).get("error", "invalid JSON")
    if isinstance(body, bytes) and (problem := not_utf8(body)):
        return None, problem
    if reason.startswith("recursion limit exceeded"):
        return None, too_deep(JITER_DEPTH)
    if reason.startswith("number out of range") and isinstance(body, (bytes, str)):  # pydantic's parser
        return integer_too_large(body)
    where = next((p for p in err.get("loc", ()) if isinstance(p, int)), None)
    return None, f"the body is not valid JSON: {reason}" + (f" at character {where}" if where is not None else "")


def integer_too_large(body: bytes | str) -> tuple[str | None, str]:
    """A number longer than the JSON parsers read (Python's cap on an integer's digits; pydantic's parser has the
    same): (the field it was sent in, when found, a message naming it)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    cap = sys.get_int_max_str_digits()
    number = re.search(rf"\d{{{cap + 1},}}", text)
    keys = re.findall(r'"((?:[^"\\]|\\.){1,100})"\s*:', text[: number.start()]) if number else []
    digits = f"{len(number.group())} digits" if number else f"more than {cap} digits"
    message = f"integer too large ({digits}, the most read is {cap}); no field takes a number that long"
    return (keys[-1], f"{keys[-1]}: {message}") if keys else (None, f"the body holds an {message}")


def _json_kind(value: Any) -> str:
    return JSON_KINDS.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, float) and not math.isfinite(value):  # as JSON spells it, which is what was sent
        return "NaN" if math.isnan(value) else ("-Infinity" if value < 0 else "Infinity")
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def raise_validation(exc: ValidationError) -> None:
    """Re-raise a pydantic error from a hand-validated body as a request validation error."""
    raise RequestValidationError(exc.errors(include_url=False)) from None


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    label_named_model(request, getattr(exc, "body", None))
    if _not_json(request, exc):
        return error_response(
            415,
            f"send the body as JSON with Content-Type: application/json "
            f"(got {request.headers.get('content-type') or 'no content type'})",
            None,
            "unsupported_media_type",
        )
    errors = list(exc.errors())
    if _is_empty_body(errors, getattr(exc, "body", None)):
        return error_response(400, empty_body(request.url.path), None, "invalid_json")
    message, param = validation_message(errors)
    code = "invalid_json" if any(_not_an_object(e) for e in errors) else "invalid_value"
    return error_response(400, message, param, code)


def _is_empty_body(errors: list[dict[str, Any]], parsed: Any) -> bool:
    """No body, or only whitespace: FastAPI says the body is missing or gives the text it failed on (`parsed`);
    pydantic's parser (the image route's) gives the body as the error's input."""
    for err in errors:
        if err.get("type") == "missing" and tuple(err.get("loc", ())) == ("body",):
            return True
        text = err.get("input") if isinstance(err.get("input"), (bytes, str)) else parsed
        if err.get("type") == "json_invalid" and isinstance(text, (bytes, str)) and not text.strip():
            return True
    return False


def _not_json(request: Request, exc: RequestValidationError) -> bool:
    """A JSON endpoint's body came without a JSON content type (so it was not parsed)."""
    whole_body = any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors())
    return whole_body and not is_json(request.headers.get("content-type"))


def label_named_model(request: Request, body: Any) -> None:
    """Label a refused request's metrics with the model it named, when that model is loaded."""
    server = getattr(request.app.state, "server", None)
    if server is not None and isinstance(body, dict):
        server.label_model(request, body.get("model"))


HTTP_ERROR_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    unparsed = await _unparsed_body(exc.__cause__, request) if exc.status_code == 400 else None
    if unparsed is not None:
        param, message = unparsed
        return error_response(400, message, param, "invalid_json")
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/images/completions"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    code = HTTP_ERROR_CODES.get(exc.status_code, "http_error")
    return error_response(exc.status_code, message, None, code, getattr(exc, "headers", None))


async def _unparsed_body(cause: BaseException | None, request: Request) -> tuple[str | None, str] | None:
    """Why FastAPI could not read a JSON body, where its "There was an error parsing the body" does not say:
    (the field at fault if known, why)."""
    if isinstance(cause, UnicodeDecodeError) and isinstance(cause.object, bytes):
        problem = not_utf8(cause.object)
        return (None, problem) if problem else None
    if isinstance(cause, RecursionError):  # Python's json parser: as deep as the recursion limit, which others move
        return None, too_deep(None)
    if isinstance(cause, ValueError) and "digits" in str(cause):  # Python's cap on an integer's length
        return integer_too_large(await request.body())  # read already: FastAPI failed to parse it
    return None


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this answer, so uvicorn logs the traceback once.
    return error_response(
        500, f"internal server error ({type(exc).__name__}); the request was not completed", None, "internal_error"
    )


def install(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
