"""Continuous batching over preallocated state slots: one engine per model.

The engine ties three parts together on one worker thread that owns the
model: the `Scheduler` (queue, admission, row map; plain data), the
`ModelRunner` (slot tensors, prefill, sampling, decode, scoring) and the
stream layer (`streams.deliver`, the hop to asyncio). Every step: waiting
requests join (prompts of one length prefill in one forward; the n samples
of a prompt copy its row), one token is drawn for every live row, finished
rows leave (the last live row moves into each hole), and one batched
decode step feeds the new tokens. A pass is a pipeline of plain data
(server/engine/step.py), each part owning its own: the scheduler's plan
(`schedule`), the runner's tokens (`execute`), the scheduler's update
(`update_from_output`: rows advanced, finished, resampled, compacted), the
runner's share of it (`apply`: row copies, sample reads, row moves), then the
pass's figures (`StepStats`) with its events to the engine's output
(server/engine/output.py), which records them on the API side: the engine
calls no metric. A pass's last tokens go into the model (`feed`) as the next
pass executes, so its events go out before that forward runs.

Multi-step (vLLM's name): while no running request is streamed or runs
particles that weigh known tokens (or several particles a sample: they
conclude together), nobody sees a step's tokens before its request ends, so the
engine runs up to `scheduler_steps` of them (never past a row's budget)
and does the host work above once for all; a row that stops within them
drops its later tokens, and its state is discarded with the row. The engine
runs those unwatched steps one runner call each, and between two of them
decides whether a request that arrived meanwhile ends the run early: when
its client watches each step, or when its idle slot would lose more than
stopping costs the running rows (server/engine/multistep.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch

from model.kernels.threads import adopt_process_threads
from model.transformer import Transformer
from model.io.vocabulary import Vocabulary, byte_vocabulary

from server.engine.base import EngineFacts, EngineLimits
from server.engine.multistep import PassCosts, ends_run_early
from server.engine.runner import ModelRunner
from server.engine.scheduler import Placement, QueueFull, Scheduler, Submission
from server.engine.output import EngineOutput, Gauges
from server.engine.step import AppliedStep, RunnerOutput, SchedulerOutput, StepUpdate
from server.engine.step_events import step_results
from server.engine.streams import (
    ENGINE_ERROR,
    ENGINE_RESTARTING,
    SHUTTING_DOWN,
    EngineFailure,
    Event,
    EventSink,
    EventTarget,
    GenerationStream,
    LoopSink,
    ScoreJob,
    ScoreReply,
    finish,
    hand_over,
    reply_in_loop,
)
from server.engine.types import GenerationError, GenerationRequest, PromptScores, StepStats
from server.engine.validation import check_generation, check_scoring
from server.engine.watchdog import Heartbeat

if TYPE_CHECKING:
    from model.decode.compiled.background import CompileGate

__all__ = ["Engine", "EngineFacts", "EngineFailure", "EngineLimits", "GenerationStream", "QueueFull"]

log = logging.getLogger("rnnserve.engine")
IDLE_WAKEUP_SECONDS = 1.0  # refresh rate gauges while idle


class Engine(EngineFacts):
    """Continuous batching for one model on a worker thread of its own (see the module's docstring)."""

    def __init__(
        self,
        name: str,
        model: Transformer,
        info: dict[str, Any],
        limits: EngineLimits,
        output: EngineOutput,
        compile_gate: CompileGate | None = None,
        threads: int | None = None,
        vocabulary: Vocabulary | None = None,
    ):
        """output: where each pass's figures and events go (server/engine/output.py). compile_gate: a lock the server's engines share, so their background compiles take turns.
        threads: intra-op CPU threads for this engine's steps (server/engine/cpu_budget.py); None: the process's count."""
        self.name = name
        self.threads = threads or torch.get_num_threads()
        self.model = model.eval()
        self.info = info
        self.limits = limits
        self.vocabulary = vocabulary or byte_vocabulary()  # a text model's tokens (stop sequences match bytes)
        self.state_bytes_per_sequence = model.state_bytes_per_sequence()  # at max_len
        self.state_bytes_allocated = 0  # all slots' state, known once started
        self.output = output
        self.metrics = output.metrics  # the model's series, for the handlers (None in an engine process)
        self.scheduler = Scheduler(limits.max_batch, limits.max_waiting, self.vocabulary)
        self.runner = make_runner(model, limits, compile_gate)
        self._lock = threading.Lock()  # the scheduler's queue: submissions come from the event loop
        self._wakeup = threading.Event()
        self._ready = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._start_error: Exception | None = None
        self._scores: list[ScoreJob] = []  # scoring waits for the worker, bounded like the queue
        self._costs = PassCosts()
        self.heartbeat = Heartbeat()  # stamped by the worker's loop; an engine process's is its client's
        self._hung = False  # the watchdog found it silent with work (server/engine/watchdog.py); until its next beat
        self._prefix_counted = (0, 0)  # the prefix cache's queried and hit tokens already in a pass's figures

    # -- public API (event-loop side) ---------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping and not self._hung

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs (known once started)."""
        return self.runner.decoder is not None and self.runner.decoder.graphed

    @property
    def compiled_decode(self) -> bool:
        """Whether decode steps run through compiled graphs (false until the background compile is done)."""
        return self.runner.decoder is not None and self.runner.decoder.compiled

    @property
    def cpu_route(self) -> str | None:
        """What the decode steps run on (model/decode/eager_and_cuda_graphs.py's `describe_route`); None on a GPU or
        before start."""
        decoder = self.runner.decoder
        return decoder.describe_route() if decoder is not None and self.model.device.type == "cpu" else None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compile of the decode steps; True once nothing is left to compile."""
        return self.runner.decoder is None or self.runner.decoder.wait_compiled(timeout)

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting_sequences

    def start(self) -> None:
        """Start the worker; raises EngineFailure if it cannot allocate its state slots."""
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise EngineFailure(
                f"model {self.name!r}: cannot allocate {self.limits.max_batch} decode slots "
                f"({self._start_error}); lower --max-batch"
            )

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()

    def submit(
        self,
        request: GenerationRequest,
        each_event: bool = True,
        sink: EventSink | None = None,
        checked: bool = False,
        report_gauges: bool = True,
    ) -> GenerationStream:
        """Queue a request (thread-safe); each_event=False hands its events over only once it has finished.
        Its events go to `sink`, by default the calling event loop. checked: the request was validated already
        (by the API process, for an engine process), so it is not checked again. report_gauges=False: the
        caller reports the queue's gauges itself (an engine process, with its answer to the submit)."""
        if not checked:
            check_generation(request, self.name, self.config, self.limits.max_batch)
        stream = GenerationStream(request, sink or LoopSink(asyncio.get_running_loop()), each_event)
        with self._lock:
            try:
                self.scheduler.add(stream)
            except QueueFull as exc:
                raise QueueFull(f"model {self.name!r}: {exc}") from None
        if report_gauges:
            self.output.gauges(Gauges(self.running, self.waiting))
        self._wakeup.set()
        return stream

    async def enqueue(self, request: GenerationRequest, each_event: bool = True) -> GenerationStream:
        """`submit` from the event loop: what handlers call, alike for an engine in another process."""
        return self.submit(request, each_event)

    async def score(self, tokens: list[int], top: int = 0) -> PromptScores:
        """Log-probability of each token given those before it (the first given BOS), and the `top`
        most likely tokens at each position; computed on the worker thread."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PromptScores] = loop.create_future()
        self.queue_score(tokens, top, reply_in_loop(loop, future))
        return await future

    def queue_score(self, tokens: list[int], top: int, reply: ScoreReply) -> None:
        """Queue a prompt to score (thread-safe); `reply(result, error)` runs on the worker thread."""
        check_scoring(tokens, self.name, self.config)
        with self._lock:
            if len(self._scores) >= max(1, self.limits.max_waiting):
                raise QueueFull(f"model {self.name!r} is scoring {len(self._scores)} prompts, the limit; retry later")
            self._scores.append(ScoreJob(tokens, top, reply))
        self._wakeup.set()

    # -- worker thread --------------------------------------------------------
    def _run(self) -> None:
        adopt_process_threads(self.threads)
        with torch.inference_mode():
            try:
                self.runner.allocate()
            except (RuntimeError, MemoryError) as exc:  # out of memory: report, do not hang start()
                self._start_error = exc
                self._ready.set()
                return
            self.state_bytes_allocated = self.runner.slots.state.nbytes()
            self.output.gauges(Gauges(0, 0, idle=True, state_allocated=self.state_bytes_allocated))
            self._ready.set()
            while not self._stopping:
                self.heartbeat.beat()
                self._hung = False
                try:
                    with self.heartbeat.paused():  # tracing a compile's graphs may take minutes: not a hang
                        self.runner.adopt_compiled()  # a background compile's graphs, between two steps
                    self._score_waiting()
                    self._admit()
                    if self.scheduler.rows:
                        self._step()
                    else:
                        self._idle()
                except Exception as exc:  # keep serving: fail what was running, not the engine
                    log.exception("engine %s failed a step", self.name)
                    self._fail_running(f"internal error while generating: {exc}")
            self._fail_all("the server is shutting down", SHUTTING_DOWN)

    def _idle(self) -> None:
        self.output.gauges(Gauges(0, self.waiting, idle=True))
        self._wakeup.wait(IDLE_WAKEUP_SECONDS)
        self._wakeup.clear()

    def _score_waiting(self) -> None:
        if not self._scores:
            return
        with self._lock:
            jobs, self._scores = self._scores, []
        for job in jobs:
            try:
                job.resolve(self.runner.score(job.tokens, job.top))
            except Exception as exc:
                job.resolve(error=EngineFailure(f"scoring failed: {exc}"))

    def _admit(self) -> None:
        """Move every waiting request that fits into the batch; prompts of one length prefill together."""
        with self._lock:
            gone = streams(self.scheduler.drop_cancelled())
            taken = streams(self.scheduler.take_admissible())
        if gone:
            finish(gone)
        if not taken:  # the usual step: nothing to admit
            return
        try:
            self._prefill_groups(taken)
        finally:
            self.scheduler.admitted()

    def _prefill_groups(self, taken: list[GenerationStream]) -> None:
        """Prefill the taken requests, one forward per prompt length; a failed group fails only itself."""
        finish([s for s in taken if s.cancelled])
        groups: dict[int, list[GenerationStream]] = defaultdict(list)
        for stream in taken:
            if not stream.cancelled:
                groups[len(stream.request.prompt)].append(stream)
        for group in groups.values():
            try:
                self._prefill(group)
            except Exception as exc:
                log.exception("prefill failed")
                finish(group, f"prefill failed: {exc}")

    def _prefill(self, group: list[GenerationStream]) -> None:
        """Write the group's rows, then register them: a failure leaves none of the group decoding."""
        places: list[Placement] = self.scheduler.placements(group)
        likelihoods = self.runner.prefill([s.request for s in group], places[0].row)
        for stream, cached in zip(group, self.runner.cached):
            stream.cached_tokens = cached
        self.runner.place_copies(places)
        self.scheduler.register(places, dict(zip(group, likelihoods)))

    def _step(self) -> None:
        """One pass, as data from part to part (server/engine/step.py)."""
        plan = self.scheduler.schedule(self.limits.scheduler_steps)
        drawn = self._execute(plan)
        update = self.scheduler.update_from_output(plan, drawn)
        applied = self.runner.apply(update, drawn)
        self._emit(update, drawn, applied)

    def _execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """The last pass's tokens into the model (its events went out before this forward), then the pass's
        unwatched steps, while no waiting request should join first, then its watched one."""
        started = time.monotonic()
        self.runner.feed()
        fed, ahead = time.monotonic(), list[torch.Tensor]()
        while len(ahead) < plan.steps - 1 and not self._ends_run_early(plan.steps - 1 - len(ahead)):
            ahead.append(self.runner.run_ahead(plan))
        if ahead:
            self._costs.observe_steps(time.monotonic() - fed, len(ahead))
        return self.runner.execute(plan, started, ahead)

    def _emit(self, update: StepUpdate, drawn: RunnerOutput, applied: AppliedStep) -> None:
        """The pass's figures and events to the engine's output (figures first: a client that has its answer finds
        the step counted); the pass boundary's host work timed for `_ends_run_early`."""
        stats, outbox = step_results(update, drawn, applied, time.monotonic() - drawn.started)
        self.output.step(self._with_prefix_figures(stats), outbox)
        self._costs.observe_boundary(time.monotonic() - drawn.ended)

    def _with_prefix_figures(self, stats: StepStats) -> StepStats:
        """The pass's figures with the prefix cache's: tokens looked up and found since the last pass, and what
        it holds."""
        cache = self.runner.prefix_cache
        if cache is None:
            return stats
        queried, hit = cache.queried_tokens, cache.hit_tokens
        counted, self._prefix_counted = self._prefix_counted, (queried, hit)
        return replace(
            stats,
            prefix_queried=queried - counted[0],
            prefix_hit=hit - counted[1],
            prefix_bytes=cache.bytes_held,
            prefix_entries=cache.entries,
        )

    def _ends_run_early(self, steps_left: int) -> bool:
        """Whether waiting requests should join now rather than at the run's end."""
        self.heartbeat.beat()  # once a step of a multi-step run
        if not self.scheduler.waiting:  # the usual step; read without the lock: a stale answer moves a join by a step
            return False
        with self._lock:  # submissions append to the queue (and drop cancelled requests from it) meanwhile
            return ends_run_early(self.scheduler, steps_left, self._costs)

    # -- the watchdog's calls (server/engine/watchdog.py; its thread) ----------------------------------------
    def has_work(self) -> bool:
        return bool(self.scheduler.rows or self.scheduler.waiting or self._scores)

    def hung(self, silent_seconds: float) -> None:
        """A thread cannot be killed: say the engine is not ready and end its requests (they are cancelled, so
        should the step ever return, the engine drops them); it serves again once its loop beats again."""
        if self._hung:
            return
        self._hung = True
        owners = [seq.owner for seq in list(self.scheduler.rows)] + list(self.scheduler.waiting)
        streams = [cast(GenerationStream, owner) for owner in dict.fromkeys(owners)]  # an engine's submissions
        log.error(
            "model %s: its engine thread has made no progress for %.1f s with %d request(s) in flight; they fail "
            "with 503 engine_restarting and the model is not ready until the engine moves again",
            self.name,
            silent_seconds,
            len(streams),
        )
        message = f"model {self.name!r}: its engine stopped making progress; retry shortly"
        for stream in streams:
            stream.cancel()
        failed: list[tuple[EventTarget, list[Event]]] = [
            (s, [GenerationError(s.request.request_id, message, ENGINE_RESTARTING)]) for s in streams
        ]
        hand_over(failed)
        for job in list(self._scores):  # should the engine reach them later, their settled futures ignore it
            job.resolve(error=EngineFailure(message, ENGINE_RESTARTING))

    def _fail_running(self, message: str, code: str = ENGINE_ERROR) -> None:
        self.runner.drop_unfed()  # the rows those tokens were for are gone
        finish(streams(self.scheduler.clear_rows()), message, code)
        self.output.gauges(Gauges(0, self.waiting))

    def _fail_all(self, message: str, code: str) -> None:
        with self._lock:
            waiting = streams(self.scheduler.take_waiting())
            scores, self._scores = self._scores, []
        finish(waiting, message, code)
        for job in scores:
            job.resolve(error=EngineFailure(message, code))
        self._fail_running(message, code)


def streams(submissions: list[Submission]) -> list[GenerationStream]:
    """The scheduler's submissions as what they are in an engine: the streams `submit` queued."""
    return cast(list[GenerationStream], submissions)


def make_runner(model: Transformer, limits: EngineLimits, compile_gate: CompileGate | None) -> ModelRunner:
    """The engine's device side, as its limits say (slots, CUDA graphs, compiled steps, prefix cache)."""
    return ModelRunner(
        model,
        limits.max_batch,
        limits.cuda_graphs,
        limits.compile_decode,
        compile_gate,
        limits.prefix_cache_memory,
        limits.prefix_cache_every,
    )
