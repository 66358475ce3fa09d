"""GET /v1/models, /v1/models/{id}, /health, /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from server.api.deps import ServerState, get_server
from server.engine.base import EngineHandle
from server.engine.client import EngineClient
from server.engine.pool import EnginePool
from server.engine.prefix_cache import LOGIT_BYTES
from server.api.errors import APIError, error_response
from server.engine.registry import eval_metrics
from server.api.responses import errors

router = APIRouter()


class EngineProcess(BaseModel):
    worker: int = Field(description="the worker's index, 0 to workers - 1")
    pid: int | None = Field(description="its process ID (a restarted worker gets a new one)")


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    task: str
    attention: str
    parameters: int
    max_len: int = Field(description="the longest sequence the model takes (its own, or --max-model-len)")
    max_model_len: int = Field(description="vLLM's name for max_len")
    device: str
    dtype: str
    kv_cache_dtype: str | None = Field(
        description="the numbers a softmax model's cached keys and values, or a hybrid model's ring of its last "
        "keys and values, are stored in (--kv-cache-dtype; a hybrid's sums stay float32); null for kinds that keep "
        "theirs in the model's dtype (Reformer) or whose state is recurrent sums (linear, Linformer: float32)"
    )
    cuda_graphs: bool
    compiled_decode: bool = Field(
        description="decode steps run through torch.compile graphs on the CPU "
        "(false until the background compile is done)"
    )
    threads: int = Field(
        description="intra-op CPU threads each of this model's engine workers steps on: its equal share of the "
        "CPUs the server may use (affinity and cgroup quota) or --threads, divided among its workers"
    )
    workers: int = Field(
        description="engine processes serving this model, each with its own slots and queue; a request runs on "
        "the one with the fewest rows in flight (--workers; by default one a thread for a small model on the CPU)"
    )
    cpu_route: str | None = Field(
        description="on the CPU, what its decode steps run on now: the vector route of the C++ kernels its engine "
        "loaded (avx512, avx2, generic, scalar: from the CPU's features, or RNNSERVE_CPU_ROUTE), whether its steps "
        "run compiled yet, and what their linear layers run on; null on a GPU"
    )
    tokenizer: str | None = Field(
        description="a text model's tokens: 'bytes' (UTF-8, one byte a token), or the tokenizer stored with an "
        "imported model and its size (e.g. 'BPE (50257 tokens)'); null for image models"
    )
    chat_template: bool = Field(
        description="a text model that can chat (POST /v1/chat/completions): its file holds a chat template, or "
        "the server was given one (--chat-template)"
    )
    state_bytes_per_sequence: int = Field(description="decode state of one sequence at max_len")
    state_bytes_allocated: int = Field(
        description="decode state preallocated for all slots (the gauge rnnserve_decode_state_allocated_bytes)"
    )
    decode_slots: int = Field(
        description="sequences each engine worker decodes at once: --max-batch, or fewer when the decode memory "
        "budget (--kv-cache-memory) holds fewer"
    )
    decode_slot_bytes: int = Field(
        description="what one slot takes: a sequence's decode state at max_len and its per-row buffers"
    )
    decode_memory_budget: int | None = Field(
        description="this model's share of --kv-cache-memory (or --kv-cache-memory-fraction), in bytes; null: none"
    )
    prefix_cache_memory: int = Field(
        description="bytes of decode states each engine worker keeps by prefix (--prefix-cache-memory); 0: no "
        "prefix cache (turned off, or a model whose state cannot be snapshot at a prefix)"
    )
    prefix_cache_bytes_per_prefix: int | None = Field(
        description="what one cached prefix holds at max_len (its decode state and next-token logits; a linear or "
        "Linformer state is that size at any length, a softmax one grows with it); null: no prefix cache"
    )
    prefix_cache_every: int = Field(
        description="tokens read before the first of the decode states a prompt's prefill keeps in the prefix cache "
        "(--prefix-cache-every; then after each doubling of them), for a constant-size state (linear, Linformer, "
        "hybrid); 0: none kept mid-prompt but at branch points (turned off, no prefix cache, a budget that holds no "
        "more than one state, or a softmax or Reformer cache, whose longer snapshots serve any shorter prefix)"
    )
    metrics: dict[str, Any] = Field(description="evaluation results stored in the weights file")
    config: dict[str, Any]
    ready: bool
    engine_processes: list[EngineProcess] = Field(
        description="the model's engine processes (one per worker; none with --no-engine-process)"
    )


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    models: dict[str, str]


PROMETHEUS_TEXT = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


def dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def describe(engine: EngineHandle, created: int, chat_template: bool = False) -> dict[str, Any]:
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
        "max_model_len": cfg.max_len,
        "device": str(engine.model.device),
        "dtype": dtype_name(engine.model.dtype),
        "kv_cache_dtype": dtype_name(engine.model.cache_dtype()),
        "cuda_graphs": engine.cuda_graphs,
        "compiled_decode": engine.compiled_decode,
        "threads": engine.threads,
        "workers": engine.workers,
        "cpu_route": engine.cpu_route,
        "tokenizer": engine.vocabulary.name if cfg.task == "text" else None,
        "chat_template": chat_template,
        **memory(engine),
        "metrics": eval_metrics(engine.info),
        "config": {
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "pos_encoding": cfg.pos_encoding,
        },
        "ready": engine.ready,
        "engine_processes": engine_processes(engine),
    }


def memory(engine: EngineHandle) -> dict[str, int | None]:
    """The model's decode state, decode slots and prefix cache, in bytes."""
    cached = engine.limits.prefix_cache_memory
    return {
        "state_bytes_per_sequence": engine.state_bytes_per_sequence,  # one sequence at max_len
        "state_bytes_allocated": engine.state_bytes_allocated,  # = rnnserve_decode_state_allocated_bytes
        "decode_slots": engine.limits.max_batch,
        "decode_slot_bytes": engine.limits.slot_bytes,
        "decode_memory_budget": engine.limits.memory_budget,
        "prefix_cache_memory": cached,
        "prefix_cache_bytes_per_prefix": (
            engine.state_bytes_per_sequence + LOGIT_BYTES * engine.config.vocab_out if cached else None
        ),
        "prefix_cache_every": engine.limits.prefix_cache_every,
    }


def engine_processes(engine: EngineHandle) -> list[dict[str, int | None]]:
    """Each engine process of the model, by worker index, with its PID (to find it in `ps`, or kill it); none for
    an engine on a thread of this process."""
    workers = engine.clients if isinstance(engine, EnginePool) else [engine]
    return [{"worker": w.worker, "pid": w.pid} for w in workers if isinstance(w, EngineClient)]


@router.get("/v1/models", response_model=ModelList, responses=errors(401))
async def list_models(server: ServerState = Depends(get_server)) -> dict[str, Any]:
    return {"object": "list", "data": [card(server, e.name) for e in server.engines]}


@router.get("/v1/models/{model_id}", response_model=ModelCard, responses=errors(401, 404))
async def get_model(model_id: str, server: ServerState = Depends(get_server)) -> dict[str, Any]:
    engine = server.engines.engines.get(model_id)
    if engine is None:
        raise APIError(
            404,
            f"model '{model_id}' is not loaded; loaded models: {', '.join(server.engines.engines)}",
            "model",
            "model_not_found",
        )
    return card(server, model_id)


def card(server: ServerState, name: str) -> dict[str, Any]:
    engines = server.engines
    return describe(engines.engines[name], engines.created.get(name, 0), name in engines.chat_templates)


@router.get("/health", response_model=Health, responses=errors(503))
async def health(server: ServerState = Depends(get_server)) -> Response:
    not_ready = server.engines.not_ready()
    if not_ready:
        retry = min(e.retry_after_seconds() for e in server.engines if e.name in not_ready)
        return error_response(
            503, f"models not ready: {', '.join(not_ready)}", None, "not_ready", {"Retry-After": str(retry)}
        )
    return JSONResponse({"status": "ok", "models": {e.name: "ready" for e in server.engines}})


@router.get("/metrics", response_class=Response, responses=PROMETHEUS_TEXT)  # open: scrapers send no key
async def metrics(server: ServerState = Depends(get_server)) -> Response:
    body, content_type = server.metrics.render()
    return Response(body, media_type=content_type)
