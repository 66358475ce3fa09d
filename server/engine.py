"""Continuous batching over preallocated state slots: one engine per model.

The engine ties three parts together on one worker thread that owns the
model: the `Scheduler` (queue, admission, row map; plain data), the
`ModelRunner` (slot tensors, prefill, sampling, decode, scoring) and the
stream layer (`streams.deliver`, the hop to asyncio). Every step: waiting
requests join (prompts of one length prefill in one forward; the n samples
of a prompt copy its row), one token is drawn for every live row, finished
rows leave (the last live row moves into each hole), and one batched
decode step feeds the new tokens. Each step's figures reach the metrics as
one `StepStats`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.transformer import Transformer

from .metrics import Metrics
from .runner import ModelRunner
from .scheduler import CANCELLED, Placement, QueueFull, Scheduler, Sequence, StepOutcome
from .streams import DONE, EngineFailure, GenerationStream, Outbox, call_in_loop, deliver, finish
from .types import Generation, GenerationRequest, SampleResult
from .validation import check_fits, check_generation, check_scoring

__all__ = ["Engine", "EngineFailure", "EngineLimits", "GenerationStream", "QueueFull"]

log = logging.getLogger("rnnserve.engine")
IDLE_WAKEUP_SECONDS = 1.0  # refresh rate gauges while idle


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int = 64
    max_waiting: int = 256
    cuda_graphs: bool = True  # capture decode steps on CUDA (linear, Linformer)
    compile_decode: bool = True  # compile decode steps on the CPU (softmax, linear, Linformer)


@dataclass
class _ScoreJob:
    tokens: list[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class Engine:
    def __init__(self, name: str, model: Transformer, info: dict, limits: EngineLimits, metrics: Metrics):
        self.name = name
        self.model = model.eval()
        self.info = info
        self.limits = limits
        self.metrics = metrics.for_model(name, model.config.attention)
        self.state_bytes_per_sequence = model.state_bytes_per_sequence()
        self.scheduler = Scheduler(limits.max_batch, limits.max_waiting)
        self.runner = ModelRunner(model, limits.max_batch, limits.cuda_graphs, limits.compile_decode)
        self._lock = threading.Lock()  # the scheduler's queue: submissions come from the event loop
        self._wakeup = threading.Event()
        self._ready = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._start_error: Exception | None = None
        self._scores: list[_ScoreJob] = []  # scoring waits for the worker, bounded like the queue

    # -- public API (event-loop side) ---------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def attention(self) -> str:
        return self.model.config.attention

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs (known once started)."""
        return self.runner.decoder is not None and self.runner.decoder.graphed

    @property
    def compiled_decode(self) -> bool:
        """Whether decode steps run through compiled graphs (false until the background compile is done)."""
        return self.runner.decoder is not None and self.runner.decoder.compiled

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
            raise EngineFailure(f"model {self.name!r}: cannot allocate {self.limits.max_batch} decode slots "
                                f"({self._start_error}); lower --max-batch")

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()

    def submit(self, request: GenerationRequest, each_event: bool = True) -> GenerationStream:
        """Queue a request; each_event=False hands its events over only once it has finished."""
        check_generation(request, self.name, self.config.max_len, self.limits.max_batch)
        stream = GenerationStream(request, asyncio.get_running_loop(), each_event)
        with self._lock:
            try:
                self.scheduler.add(stream)
            except QueueFull as exc:
                raise QueueFull(f"model {self.name!r}: {exc}") from None
        self.metrics.queue(self.running, self.waiting)
        self._wakeup.set()
        return stream

    def check_prompt(self, tokens: list[int]) -> None:
        """Raise InvalidRequest unless `tokens` are valid and fit this model's context."""
        check_fits(tokens, 0, self.name, self.config.max_len)

    async def score(self, tokens: list[int]) -> list[float]:
        """Log-probability of each token given those before it (the first given BOS), on the worker."""
        check_scoring(tokens, self.name, self.config.max_len)
        if len(self._scores) >= max(1, self.limits.max_waiting):
            raise QueueFull(f"model {self.name!r} is scoring {len(self._scores)} prompts, the limit; retry later")
        loop = asyncio.get_running_loop()
        job = _ScoreJob(tokens, loop.create_future(), loop)
        with self._lock:
            self._scores.append(job)
        self._wakeup.set()
        return await job.future

    # -- worker thread --------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            try:
                self.runner.allocate()
            except (RuntimeError, MemoryError) as exc:  # out of memory: report, do not hang start()
                self._start_error = exc
                self._ready.set()
                return
            self._ready.set()
            while not self._stopping:
                try:
                    self._score_waiting()
                    self._admit()
                    if self.scheduler.rows:
                        self._step()
                    else:
                        self._idle()
                except Exception as exc:  # keep serving: fail what was running, not the engine
                    log.exception("engine %s failed a step", self.name)
                    self._fail_running(f"internal error while generating: {exc}")
            self._fail_all("server is shutting down")

    def _idle(self) -> None:
        self.metrics.idle(self.waiting)
        self._wakeup.wait(IDLE_WAKEUP_SECONDS)
        self._wakeup.clear()

    def _score_waiting(self) -> None:
        if not self._scores:
            return
        with self._lock:
            jobs, self._scores = self._scores, []
        for job in jobs:
            try:
                result = self.runner.score(job.tokens)
                call_in_loop(job.loop, _resolve, job.future, result, None)
            except Exception as exc:
                call_in_loop(job.loop, _resolve, job.future, None, EngineFailure(f"scoring failed: {exc}"))

    def _admit(self) -> None:
        """Move every waiting request that fits into the batch; prompts of one length prefill together."""
        with self._lock:
            gone = self.scheduler.drop_cancelled()
            taken = self.scheduler.schedule()
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
        self.runner.prefill([s.request for s in group], places[0].row)
        self.runner.place_copies(places)
        self.scheduler.register(places)

    def _step(self) -> None:
        n = self.scheduler.running
        tokens, logprobs = self.runner.sample(n, self.scheduler.wants_logprobs())
        token_list = tokens.tolist()
        outcome = self.scheduler.update_from_output(token_list, time.monotonic())
        deliver(self._events(outcome, token_list, logprobs))
        self.runner.move_rows(self.scheduler.compact(outcome.finished), tokens)
        live = self.scheduler.running
        self.runner.decode(tokens[:live])
        self.metrics.record_step(self.scheduler.make_stats(outcome, self.runner.state_bytes(live)))

    def _events(self, outcome: StepOutcome, token_list: list[int], logprobs: torch.Tensor | None) -> Outbox:
        """A Generation per streamed row, a SampleResult per finished non-streamed row, DONE per finished request."""
        outbox: Outbox = defaultdict(list)
        logprob_list = logprobs.tolist() if logprobs is not None else None
        for i, (seq, reason) in enumerate(zip(self.scheduler.rows, outcome.reasons)):
            stream, request = seq.owner, seq.owner.request
            if reason == CANCELLED:
                continue
            if stream.each_event:
                matched = seq.stopping.matched if reason else None
                outbox[stream].append(Generation(request.request_id, seq.sample, seq.position - 1, token_list[i],
                                                 logprob_list[i] if request.logprobs else None, reason, matched))
            elif reason is not None:
                outbox[stream].append(self._result(i, seq, reason))
        for stream in outcome.completed:
            outbox[stream].append(DONE)
        return outbox

    def _result(self, row: int, seq: Sequence, reason: str) -> SampleResult:
        request = seq.owner.request
        tokens, logprobs = self.runner.read_sample(row, seq.start, seq.position, request.logprobs)
        return SampleResult(request.request_id, seq.sample, seq.start, tokens, logprobs, reason, seq.stopping.matched)

    def _fail_running(self, message: str) -> None:
        finish(self.scheduler.clear_rows(), message)
        self.metrics.queue(0, self.waiting)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            waiting = self.scheduler.take_waiting()
            scores, self._scores = self._scores, []
        finish(waiting, message)
        for job in scores:
            call_in_loop(job.loop, _resolve, job.future, None, EngineFailure(message))
        self._fail_running(message)


def _resolve(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
