"""OpenAI-style JSON errors for every 4xx/5xx the server sends.

Body: {"error": {"message", "type", "param", "code"}}. Handlers raise
`APIError`; validation errors, unknown routes, and anything unexpected are
turned into the same shape by the handlers installed with `install`.
"""

from __future__ import annotations

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
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answer: status, a message saying what to fix, and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
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


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic errors -> ("field: what is wrong; ...", first field)."""
    parts, params = [], []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        params.append(loc[0] if loc else None)  # OpenAI names the top-level field
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {_short(got)})"
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}{shown}")
    return "; ".join(parts) or "invalid request", (params[0] if params else None)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def raise_validation(exc: ValidationError) -> None:
    """Re-raise a pydantic error from a hand-validated body as a request validation error."""
    raise RequestValidationError(exc.errors(include_url=False)) from None


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(list(exc.errors()))
    return error_response(400, message, param, "invalid_value")


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/completions, POST /v1/images/completions"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, None, None, getattr(exc, "headers", None))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this answer, so uvicorn logs the traceback once.
    return error_response(500, f"internal server error ({type(exc).__name__}); the request was not completed", None, "internal_error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
