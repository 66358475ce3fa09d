"""What handlers share, and the one dependency that hands it to them."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from server.metrics import Metrics
from server.engine.registry import EngineRegistry
from server.settings import Settings


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    engines: EngineRegistry


async def get_server(request: Request) -> ServerState:
    """Settings, metrics and engines of this app (set by the lifespan). Async so that FastAPI calls it on the
    event loop: a plain function would cost every request a hop to its thread pool and back."""
    return request.app.state.server
