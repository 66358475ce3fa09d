"""What every engine shares, on a thread or in a process of its own: the interface handlers use (`EngineHandle`),
its limits, and what it answers without asking its worker (the model's config, the checks of a request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from model.config import ModelConfig
from model.transformer import Transformer
from model.io.vocabulary import Vocabulary

from server.engine.validation import check_fits, check_samples

if TYPE_CHECKING:
    from server.engine.streams import GenerationStream
    from server.engine.types import GenerationRequest, PromptScores
    from server.metrics import ModelMetrics


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int = 64
    max_waiting: int = 256
    cuda_graphs: bool = True  # capture decode steps on CUDA (linear, Linformer)
    compile_decode: bool = False  # compile decode steps on the CPU (the server passes --compile-decode, default on)
    scheduler_steps: int = 8  # decode steps per scheduling pass when no client watches each step (multi-step)
    slot_bytes: int = 0  # what one decode slot holds (server/engine/slot_budget.py), for /v1/models; 0: not known
    memory_budget: int | None = None  # the model's share of the decode memory budget; None: no budget
    prefix_cache_memory: int = 0  # bytes of decode states the engine keeps by prefix (server/engine/prefix_cache.py)
    prefix_cache_every: int = (
        0  # tokens read before the first periodic state a prompt's prefill keeps (server/engine/prefix_plan.py)
    )


class EngineFacts:
    """What an engine answers without asking its worker: the model's config, and the request checks."""

    name: str
    model: Transformer
    limits: EngineLimits
    vocabulary: Vocabulary
    workers: int = 1  # engine processes serving the model (server/engine/pool.py)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def attention(self) -> str:
        return self.model.config.attention

    def retry_after_seconds(self) -> int:
        """When a client refused because the engine is not ready should try again: at least a second."""
        return 1

    def check_prompt(self, tokens: list[int], samples: int) -> None:
        """Raise InvalidRequest unless `tokens` are valid and fit this model's context, and `samples` of them
        would fit --max-batch (a request that generates nothing is held to the limits of one that does)."""
        check_fits(tokens, 0, self.name, self.config)
        check_samples(samples, self.limits.max_batch)


@runtime_checkable
class EngineHandle(Protocol):
    """One model's engine as the API process uses it: `Engine` (on a worker thread here), `EngineClient` (the
    stand-in for an engine process) and `EnginePool` (a model's several engine processes) are each one, checked
    by mypy and at run time (tests/test_engine_interface.py). Handlers, the registry, the drain and the app see
    only this. (An engine process calls its `Engine`'s wider `submit` itself: that is the engine's own side.)"""

    name: str
    model: Transformer
    info: dict[str, Any]
    limits: EngineLimits
    vocabulary: Vocabulary  # what a text model's tokens stand for: bytes, or its tokenizer's
    threads: int  # each worker's
    workers: int
    state_bytes_per_sequence: int

    @property
    def metrics(self) -> ModelMetrics | None:
        """The model's series the handlers record into."""

    @property
    def state_bytes_allocated(self) -> int:
        """Bytes of all its slots' state, known once started."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def attention(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    @property
    def cuda_graphs(self) -> bool: ...

    @property
    def compiled_decode(self) -> bool: ...

    @property
    def cpu_route(self) -> str | None: ...

    def check_prompt(self, tokens: list[int], samples: int) -> None: ...

    def retry_after_seconds(self) -> int: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def wait_compiled(self, timeout: float | None = None) -> bool: ...

    async def enqueue(self, request: GenerationRequest, each_event: bool = True) -> GenerationStream: ...

    async def score(self, tokens: list[int], top: int = 0) -> PromptScores: ...
