"""The FastAPI app factory: `build_app(settings)`.

The lifespan loads the models (unless the caller already did), starts one
engine per model, and puts everything handlers need on `app.state.server`;
handlers reach it through the one dependency `deps.get_server`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import torch
from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api import errors

from server.api import openapi
from server.engine.compile_gate import CompileTurns
from server.engine.cpu_budget import CpuBudget, usable_cpus
from server.api.deps import ServerState
from server.drain import Drain, DrainMiddleware
from server.engine.base import EngineHandle
from server.engine.core import Engine, EngineLimits
from server.engine.runner import caches_prefixes, snapshot_policy
from server.engine.output import LocalOutput
from server.engine.client import EngineClient
from server.engine.pool import EnginePool, model_bytes, worker_layout
from server.engine.slot_budget import MIB, SlotPlan, model_shares, plan_slots
from server.metrics import Metrics
from server.api.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestMetricsMiddleware
from server.engine.registry import EngineRegistry, LoadedModel, load_models
from server.api.routes_chat import router as chat_router
from server.engine.watchdog import Watched, Watchdog
from server.api.routes_images import router as images_router
from server.api.routes_models import router as models_router
from server.api.routes_playground import mount_static
from server.api.routes_playground import router as playground_router
from server.api.routes_completions import router as completions_router
from server.api.routes_tokenize import router as tokenize_router
from server.settings import Settings
from server.startup_responder import MESSAGE as STARTING_MESSAGE

if TYPE_CHECKING:
    from model.decode.compiled.decoder import CompileGate

log = logging.getLogger("rnnserve.app")


def build_app(
    settings: Settings,
    models: list[LoadedModel] | None = None,
    metrics: Metrics | None = None,
    on_started: Callable[[], None] | None = None,
    background_start: bool = False,
) -> FastAPI:
    """An app serving `models`, or the models `settings` names (loaded at start-up); its series go
    to `metrics` (default: a registry of its own, served at /metrics). `on_started` is called (on a
    worker thread) once the engines run, just before the app serves. background_start: the app serves
    at once, answering 503 `starting` until the models have started (a Ray Serve replica: Serve routes
    nothing to a replica whose start-up has not returned, so a probe would hang instead)."""
    metrics = metrics or Metrics(CollectorRegistry())
    # FastAPIOffline serves /docs and /redoc with Swagger UI and ReDoc from a Python package, no CDN.
    app = FastAPIOffline(
        title="rnnserve",
        version="0.1.0",
        lifespan=_lifespan(settings, metrics, models, on_started, background_start),
        description="Image completion, streaming text and metrics for RNN-mode transformers.",
    )
    errors.install(app)
    openapi.install(app, settings.max_batch, settings.api_key_value() is not None)
    routers = (models_router, completions_router, tokenize_router, chat_router, images_router, playground_router)
    for router in routers:
        app.include_router(router)
    mount_static(app)
    known_paths = {route.path for router in routers for route in router.routes}
    # Added innermost first: metrics see every answer, a draining server refuses before anything
    # else, the key is checked before the body is read.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, timeout=settings.body_timeout)
    if background_start:
        app.add_middleware(StartingMiddleware, state=app.state)
    if settings.api_key_value():
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key_value())
    app.state.drain = Drain(settings.drain_seconds)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, known_paths=known_paths)
    return app


def _lifespan(
    settings: Settings,
    metrics: Metrics,
    models: list[LoadedModel] | None,
    on_started: Callable[[], None] | None,
    background: bool,
):
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        life = Lifecycle(settings, metrics, models)
        starting: asyncio.Task | None = None
        try:
            if background:
                starting = asyncio.create_task(life.start_in_background(app))
            else:
                await life.start(app, on_started)
            yield
        finally:
            if starting is not None:
                await starting  # engines that start while the app stops are stopped below, not left running
            life.stop()

    return lifespan


class Lifecycle:
    """What the lifespan starts and stops: the models' engines, their compile turns, the heap freeze."""

    def __init__(self, settings: Settings, metrics: Metrics, models: list[LoadedModel] | None):
        self.settings, self.metrics, self.models = settings, metrics, models
        self.turns = CompileTurns.new()  # the engines' background compiles take turns (server/engine/compile_gate.py)
        self.started: list[EngineHandle] = []
        self.freezing: asyncio.Task | None = None
        self.watchdog: Watchdog | None = None

    async def start(self, app: FastAPI, on_started: Callable[[], None] | None = None) -> None:
        """Load the models (unless given), start their engines and put the server state on the app."""
        settings = self.settings
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)  # before any engine thread adopts the process's count
        loaded = self.models if self.models is not None else await asyncio.to_thread(load_models, settings)
        limits = EngineLimits(
            max_batch=settings.max_batch,
            max_waiting=settings.max_waiting,
            cuda_graphs=settings.cuda_graphs,
            compile_decode=settings.compile_decode,
            scheduler_steps=settings.scheduler_steps,
            prefix_cache_memory=settings.prefix_cache_memory,
            prefix_cache_every=settings.prefix_cache_every,
        )
        budget = usable_cpus()
        threads = budget.engine_threads(len(loaded), settings.threads)
        memory = model_shares(settings.decode_memory_budget(settings.torch_device()), len(loaded))
        engines = [
            make_engine(m, limits, self.metrics, settings, self.turns, n, memory) for m, n in zip(loaded, threads)
        ]
        log_thread_shares(budget, engines, settings.threads)
        self.started = await start_engines(engines)
        if settings.watchdog_seconds > 0:
            self.watchdog = Watchdog(watched_engines(engines), settings.watchdog_seconds)
            self.watchdog.start()
        created = {m.name: int(m.path.stat().st_mtime) for m in loaded}
        chat_templates = {m.name: m.chat_template for m in loaded if m.chat_template is not None}
        app.state.server = ServerState(settings, self.metrics, EngineRegistry(engines, created, chat_templates))
        log.info("serving %s", ", ".join(engine.name for engine in engines))
        self.freezing = asyncio.create_task(freeze_heap_once_compiled(engines))
        if on_started is not None:
            await asyncio.to_thread(on_started)

    async def start_in_background(self, app: FastAPI) -> None:
        """`start` while the app already answers (503 `starting`, see StartingMiddleware); a failure is kept on
        the app's state for the answers and the health check to report."""
        try:
            await self.start(app)
        except Exception as exc:
            log.exception("the models could not start")
            app.state.start_failure = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        if self.freezing is not None:
            self.freezing.cancel()
        if self.watchdog is not None:
            self.watchdog.stop()
        for engine in self.started:
            engine.stop()
        self.turns.remove()


class StartingMiddleware:
    """While the models start in the background, answer 503 `starting` (with Retry-After), as the standalone
    server's start-up responder does; once they failed to start, 503 `start_failed` saying why."""

    def __init__(self, app: ASGIApp, state: Any):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or hasattr(self.state, "server"):
            await self.app(scope, receive, send)
            return
        failure = getattr(self.state, "start_failure", None)
        if failure is None:
            answer = errors.error_response(503, STARTING_MESSAGE, None, "starting", {"Retry-After": "2"})
        else:
            answer = errors.error_response(
                503, f"the models failed to start ({failure}); see the server's log", None, "start_failed"
            )
        await answer(scope, receive, send)


async def start_engines(engines: list[EngineHandle]) -> list[EngineHandle]:
    """Start every engine at once (an engine process takes seconds to spawn and import torch); if one
    cannot start, stop those that did and raise its error."""
    outcomes = await asyncio.gather(*(asyncio.to_thread(engine.start) for engine in engines), return_exceptions=True)
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if failures:
        for engine, outcome in zip(engines, outcomes):
            if not isinstance(outcome, BaseException):
                engine.stop()
        raise failures[0]
    return engines


def make_engine(
    loaded: LoadedModel,
    limits: EngineLimits,
    metrics: Metrics,
    settings: Settings,
    compile_gate: CompileGate | None = None,
    threads: int | None = None,
    memory: int | None = None,
) -> EngineHandle:
    """The model's engine, with `threads` intra-op CPU threads: on a worker thread of this process, or
    (--engine-process) in a process of its own; `memory`: its share of the decode memory budget (None: none)."""
    if settings.engine_process:
        share = threads or torch.get_num_threads()
        return engine_processes(loaded, limits, metrics, settings, compile_gate, share, memory)
    limits = slot_limits(loaded, limits, plan_slots(loaded.name, loaded.model, limits.max_batch, 1, memory))
    output = LocalOutput.recording(metrics, loaded.name, loaded.model)
    return Engine(loaded.name, loaded.model, loaded.info, limits, output, compile_gate, threads, loaded.vocabulary)


def engine_processes(
    loaded: LoadedModel,
    limits: EngineLimits,
    metrics: Metrics,
    settings: Settings,
    compile_gate: CompileGate | None,
    share: int,
    memory: int | None = None,
) -> EngineHandle:
    """The model's engine process, or a pool of them (server/engine/pool.py) sharing its `share` of threads and
    its `memory` share of the decode memory budget."""
    on_cpu = loaded.model.device.type == "cpu"
    # --threads N keeps its meaning, N threads for each model's one engine, unless --workers is given too.
    asked = settings.workers if settings.workers is not None or settings.threads is None else 1
    layout = worker_layout(model_bytes(loaded.model), share, asked, on_cpu)
    plan = plan_slots(loaded.name, loaded.model, limits.max_batch, layout.workers, memory)
    if plan.workers < layout.workers:  # the budget holds fewer workers' slots: their threads go to the others
        layout = worker_layout(model_bytes(loaded.model), share, plan.workers, on_cpu)
    limits = slot_limits(loaded, limits, plan)
    workers = [
        EngineClient(
            loaded.name, loaded.model, loaded.info, limits, metrics, layout.threads, compile_gate, loaded.vocabulary, i
        )
        for i in range(layout.workers)
    ]
    return workers[0] if len(workers) == 1 else EnginePool(workers)


def slot_limits(loaded: LoadedModel, limits: EngineLimits, plan: SlotPlan) -> EngineLimits:
    """The engine limits with the planned decode slots, said in the log."""
    if plan.budget is not None:
        log.info(
            "model %s: %d decode slots x %d engine workers of %d bytes each (%.1f MiB of its %.1f MiB share of the "
            "decode memory budget)",
            loaded.name,
            plan.rows,
            plan.workers,
            plan.slot_bytes,
            plan.rows * plan.workers * plan.slot_bytes / MIB,
            plan.budget / MIB,
        )
    prefix = limits.prefix_cache_memory if caches_prefixes(loaded.model) else 0
    every = snapshot_policy(loaded.model, limits.prefix_cache_every, prefix).every if prefix else 0
    return dataclasses.replace(
        limits,
        max_batch=plan.rows,
        slot_bytes=plan.slot_bytes,
        memory_budget=plan.budget,
        prefix_cache_memory=prefix,
        prefix_cache_every=every,
    )


def watched_engines(engines: list[EngineHandle]) -> list[Watched]:
    """What the watchdog looks after: each engine thread, and each engine process of a pool."""
    watched: list[Watched] = []
    for engine in engines:
        watched += engine.clients if isinstance(engine, EnginePool) else [engine]  # type: ignore[list-item]
    return watched


def log_thread_shares(budget: CpuBudget, engines: list[EngineHandle], override: int | None) -> None:
    why = "--threads" if override is not None else f"an equal share of {budget.reason}"
    shares = ", ".join(f"{e.name} {e.workers} x {e.threads}" for e in engines)
    log.info("engine processes x intra-op CPU threads per model (%s): %s", why, shares)


async def freeze_heap_once_compiled(engines: list[EngineHandle]) -> None:
    """Put what start-up built (models, compiled graphs) out of the cyclic garbage collector's reach.

    A collection of the oldest generation walks every tracked object while holding the GIL, which
    stalls the engine threads; with torch and inductor loaded that is a large heap. vLLM freezes its
    heap after start-up for the same reason."""
    for engine in engines:
        while not await asyncio.to_thread(engine.wait_compiled, 1.0):
            pass
    gc.collect()
    gc.freeze()
    log.info("moved %d start-up objects out of the garbage collector's reach", gc.get_freeze_count())
