"""The OpenAPI document as this server behaves.

* No 422: validation errors answer 400 with the error body every other error
  has, so FastAPI's 422 and its validation-error schemas are dropped.
* Limits of this server, not only of the API: `n`, `best_of` and `particles`
  at most --max-batch (n x particles too, which no schema can express), `max_tokens` (and chat's
  `max_completion_tokens`) at most the longest loaded text model's max_len.
  (A prompt plus max_tokens past a model's max_len is a 400 no schema can
  express: it depends on both fields and the model.)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.api.middleware import is_open

UNUSED_SCHEMAS = ("HTTPValidationError", "ValidationError")
BEARER_SCHEME = {
    "type": "http",
    "scheme": "bearer",
    "description": "the server's --api-key, sent as 'Authorization: Bearer KEY'",
}


def install(app: FastAPI, max_batch: int, api_key_required: bool = False) -> None:
    """`api_key_required`: --api-key is set, so the document declares the key on the routes that need it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _drop_422(schema)
            limits = {"n": max_batch, "best_of": max_batch, "particles": max_batch}
            server = getattr(app.state, "server", None)
            text_lengths = [e.config.max_len for e in server.engines if e.config.task == "text"] if server else []
            if text_lengths:
                limits["max_tokens"] = limits["max_completion_tokens"] = max(text_lengths)
            _cap(schema, limits)
            if api_key_required:
                _require_key(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _drop_422(schema: dict[str, Any]) -> None:
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = schema.get("components", {}).get("schemas", {})
    for name in UNUSED_SCHEMAS:
        schemas.pop(name, None)


def _require_key(schema: dict[str, Any]) -> None:
    """Declare the bearer key, and require it on every operation the API key middleware guards."""
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = BEARER_SCHEME
    for path, operations in schema.get("paths", {}).items():
        if not is_open(path):
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]


def _cap(node: Any, limits: dict[str, int]) -> None:
    """Lower the `maximum` of every integer property named in `limits`, wherever it appears."""
    if isinstance(node, list):
        for item in node:
            _cap(item, limits)
        return
    if not isinstance(node, dict):
        return
    for name, field in node.get("properties", {}).items():
        if name in limits:
            for branch in [field, *field.get("anyOf", [])]:
                if branch.get("type") == "integer":
                    branch["maximum"] = min(branch.get("maximum", limits[name]), limits[name])
    for value in node.values():
        _cap(value, limits)
