"""One model served by several engine processes ("workers"), each on its own share of the CPUs.

Why: a decode step of a small model is a few dozen short loops. Spread over two intra-op threads, every loop
forks and joins its team, and the joins cost about what the second core wins back. Two processes on one thread
each, every one stepping its own rows, share nothing within a step, and the model's rows decode on both cores
at once (the figures are in benchmarks/results/NOTES.md, "Engine workers"). A big model is the other way round: its
steps read weights from memory, which two threads read faster than one, and a worker each would hold a copy of
them. So only small models get workers unless --workers says otherwise.

`EnginePool` stands in for the model's engine, as `EngineClient` does for one process: handlers, the registry
and the drain see one `EngineHandle`. A request goes to the ready worker with the fewest rows in flight; each
worker keeps its own --max-batch slots and --max-waiting queue.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.transformer import Transformer

from server.engine.base import EngineFacts
from server.engine.streams import EngineFailure, ENGINE_RESTARTING, SHUTTING_DOWN

if TYPE_CHECKING:
    from server.engine.client import EngineClient
    from server.engine.streams import GenerationStream
    from server.engine.types import GenerationRequest, PromptScores

# Weights up to this size make a model "small": its step is short loops over cached weights, not a stream of
# weights from memory (a core's L2 holds a few MiB; a GPT-2 small in float32 is about 500 MiB).
SMALL_MODEL_BYTES = 32 * 1024 * 1024
# At most this many workers by default: each is a process with a copy of the weights, its own slots and its own
# compile, and the joins that workers avoid matter less as a worker's threads grow.
MOST_AUTO_WORKERS = 4


@dataclass(frozen=True)
class WorkerLayout:
    """How one model's share of the CPUs is used: `workers` engine processes of `threads` threads each."""

    workers: int
    threads: int


def worker_layout(weight_bytes: int, share: int, workers: int | None, cpu_processes: bool) -> WorkerLayout:
    """The layout of a model of `weight_bytes` given `share` threads. `workers`: --workers (None: auto, a worker
    a thread for a small model, at most MOST_AUTO_WORKERS); `cpu_processes`: the engines run in processes of their
    own on the CPU (workers need both; elsewhere one engine takes the share)."""
    if not cpu_processes:
        return WorkerLayout(1, share)
    if workers is None:
        workers = min(share, MOST_AUTO_WORKERS) if weight_bytes <= SMALL_MODEL_BYTES else 1
    workers = max(1, workers)
    return WorkerLayout(workers, max(1, share // workers))


def model_bytes(model: Transformer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class EnginePool(EngineFacts):
    """A model's engine processes as one engine: the `EngineHandle` the API process uses."""

    def __init__(self, clients: list[EngineClient]):
        if not clients:
            raise ValueError("an engine pool needs at least one worker")
        self.clients = clients
        self.workers = len(clients)
        first = clients[0]
        self.name, self.model, self.info, self.limits = first.name, first.model, first.info, first.limits
        self.vocabulary, self.metrics = first.vocabulary, first.metrics  # request-side series: the model's own
        self.state_bytes_per_sequence = first.state_bytes_per_sequence
        self.threads = first.threads  # each worker's
        self._turn = 0

    @property
    def state_bytes_allocated(self) -> int:
        return sum(w.state_bytes_allocated for w in self.clients)

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.clients)

    @property
    def cuda_graphs(self) -> bool:
        return False  # workers run on the CPU only

    @property
    def compiled_decode(self) -> bool:
        return all(w.compiled_decode for w in self.clients)

    @property
    def cpu_route(self) -> str | None:
        """As a ready worker last said (all run the same route); the first worker's while none is ready."""
        return next((c.cpu_route for c in self.clients if c.ready), self.clients[0].cpu_route)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.clients)

    def retry_after_seconds(self) -> int:
        """Until the first worker's next restart attempt."""
        return min(w.retry_after_seconds() for w in self.clients)

    def start(self) -> None:
        """Start the workers at once (each takes seconds to spawn and import torch; they compile in turn,
        through the compile gate); if one cannot start, stop them all and raise its error."""
        failures = self._on_every_client("start")
        if failures:
            self.stop()
            raise failures[0]

    def stop(self) -> None:
        """Stop the workers at once, as the drain stops the models (each may take seconds to exit)."""
        failures = self._on_every_client("stop")
        if failures:
            raise failures[0]

    def _on_every_client(self, method: str) -> list[BaseException]:
        """Call `method` of every worker's client at once, each on a thread; what they raised."""
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix=f"{method}-{self.name}") as calling:
            outcomes = [calling.submit(getattr(client, method)) for client in self.clients]
        return [error for error in (outcome.exception() for outcome in outcomes) if error is not None]

    def wait_compiled(self, timeout: float | None = None) -> bool:
        return all(w.wait_compiled(timeout) for w in self.clients)

    async def enqueue(self, request: GenerationRequest, each_event: bool = True) -> GenerationStream:
        return await self._pick().enqueue(request, each_event)

    async def score(self, tokens: list[int], top: int = 0) -> PromptScores:
        return await self._pick().score(tokens, top)

    def _pick(self) -> EngineClient:
        """The ready worker with the fewest rows in flight; none ready: fail as a worker would."""
        ready = [w for w in self.clients if w.ready]
        if not ready:
            stopping = any(w.stopping for w in self.clients)
            raise EngineFailure(
                f"model {self.name!r}: none of its engine processes is running",
                SHUTTING_DOWN if stopping else ENGINE_RESTARTING,
            )
        start = self._turn % len(ready)  # ties go round: idle workers take turns
        self._turn += 1
        return min(ready[start:] + ready[:start], key=lambda w: w.rows_in_flight())
