"""GET /v1/models, /v1/models/{id}, /health, /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from .deps import ServerState, get_server
from .engine import Engine
from .errors import APIError, error_response
from .registry import eval_metrics

router = APIRouter()


def describe(engine: Engine, created: int) -> dict[str, Any]:
    """One OpenAI model entry plus what a client needs to pick a model."""
    cfg = engine.config
    return {
        "id": engine.name,
        "object": "model",
        "created": created,
        "owned_by": "rnnserve",
        "task": cfg.task,
        "attention": cfg.attention,
        "parameters": engine.model.num_parameters(),
        "max_len": cfg.max_len,
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "cuda_graphs": engine.cuda_graphs,
        "compiled_decode": engine.compiled_decode,
        "state_bytes_per_sequence": engine.state_bytes_per_sequence,
        "metrics": eval_metrics(engine.info),
        "config": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "pos_encoding": cfg.pos_encoding},
        "ready": engine.ready,
    }


@router.get("/v1/models")
async def list_models(server: ServerState = Depends(get_server)) -> dict[str, Any]:
    return {"object": "list", "data": [describe(e, server.engines.created.get(e.name, 0)) for e in server.engines]}


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, server: ServerState = Depends(get_server)) -> dict[str, Any]:
    engine = server.engines.engines.get(model_id)
    if engine is None:
        raise APIError(404, f"model '{model_id}' is not loaded; loaded models: {', '.join(server.engines.engines)}",
                       "model", "model_not_found")
    return describe(engine, server.engines.created.get(model_id, 0))


@router.get("/health")
async def health(server: ServerState = Depends(get_server)) -> Response:
    not_ready = server.engines.not_ready()
    if not_ready:
        return error_response(503, f"models not ready: {', '.join(not_ready)}", None, "not_ready")
    return JSONResponse({"status": "ok", "models": {e.name: "ready" for e in server.engines}})


@router.get("/metrics")
async def metrics(server: ServerState = Depends(get_server)) -> Response:
    body, content_type = server.metrics.render()
    return Response(body, media_type=content_type)
