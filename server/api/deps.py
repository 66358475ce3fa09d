"""What handlers share, and the one dependency that hands it to them."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from server.api.errors import APIError
from server.engine.base import EngineHandle
from server.engine.registry import EngineRegistry, ModelLookupError, ModelNotLoaded, ModelRequired, WrongModelTask
from server.metrics import Metrics
from server.settings import Settings

# What the client is told of each way a model lookup fails: status and error code (param: "model").
LOOKUP_ERRORS: dict[type[ModelLookupError], tuple[int, str]] = {
    ModelNotLoaded: (404, "model_not_found"),
    WrongModelTask: (400, "wrong_model_task"),
    ModelRequired: (400, "model_required"),
}


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    engines: EngineRegistry

    def engine_for(self, request: Request, name: str | None, task: str) -> EngineHandle:
        """The engine a request names (or its task's only one), its metrics labelled with it; a 404 or 400 saying
        which models are loaded otherwise."""
        try:
            engine = self.engines.get(name, task)
        except ModelLookupError as exc:
            status, code = LOOKUP_ERRORS[type(exc)]
            raise APIError(status, str(exc), "model", code) from None
        label_with(request, engine)
        return engine

    def label_model(self, request: Request, name: object) -> None:
        """Label a request's metrics with the model it names, if loaded, before its other fields are checked:
        a refusal then counts under that model; an unknown name stays "none", so label values stay bounded."""
        engine = self.engines.find(name)
        if engine is not None:
            label_with(request, engine)


def label_with(request: Request, engine: EngineHandle) -> None:
    request.state.model, request.state.attention = engine.name, engine.attention


async def get_server(request: Request) -> ServerState:
    """Settings, metrics and engines of this app (set by the lifespan). Async so that FastAPI calls it on the
    event loop: a plain function would cost every request a hop to its thread pool and back."""
    return request.app.state.server
