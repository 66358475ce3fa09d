"""Continuous batching over preallocated state slots; one engine per model.

A worker thread owns the model and a state of `max_batch` rows, allocated
once. Live sequences always occupy rows [0, n): when one finishes, the last
live row moves into its place, so each step runs the model on a contiguous
view of exactly the live rows. Every step: waiting requests join (prefill in
place into a free row; n samples of one prompt are copies of one prefill),
one token is sampled for every live row, finished rows leave, and one
batched decode step feeds the new tokens.

Streamed requests get a Generation event per token. A non-streamed request
gets one SampleResult per sample when it ends: its tokens are written into
a preallocated (rows, max_len) buffer by position meanwhile, so a step
builds no per-token objects for it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from model.config import BOS_TOKEN, ModelConfig
from model.cuda_graphs import EagerDecoder, make_decoder
from model.sampling import BatchSampling, force_tokens, sample, token_logprobs
from model.state import ModelState
from model.transformer import Transformer, with_bos

from .metrics import Metrics
from .types import Generation, GenerationError, GenerationRequest, SampleResult

log = logging.getLogger("rnnserve.engine")
IDLE_WAKEUP_SECONDS = 1.0  # refresh rate gauges while idle


class QueueFull(Exception):
    """The waiting queue is at its limit; the client should retry later (429)."""


class EngineFailure(RuntimeError):
    """The engine failed while running a request."""


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int = 64
    max_waiting: int = 256
    cuda_graphs: bool = True  # capture decode steps on CUDA (linear, Linformer)


_DONE = object()  # end-of-stream marker


def _is_terminal(item) -> bool:
    return item is _DONE or isinstance(item, GenerationError)


class GenerationStream:
    """What `Engine.submit` returns, cancelled on disconnect. Iterate for events: a Generation
    per token when streaming (each_event), else a SampleResult per sample at the end."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, each_event: bool = True):
        self.request = request
        self.loop = loop
        # Lists of events, one list per hand-over: a whole image is one put and one get, not 785.
        self.queue: asyncio.Queue[list] = asyncio.Queue()
        # False: the handler only wants the whole answer, so the samples' results are held by
        # the engine and handed over together at the end.
        self.each_event = each_event
        self._held: list = []  # engine thread only
        self.cancelled = False
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.live_rows = 0  # rows still decoding for this request

    def cancel(self) -> None:
        self.cancelled = True  # the worker frees the rows at its next step

    def release(self, items: list) -> list:
        """(Engine thread.) What to hand to the event loop now: everything when streaming,
        else nothing until the stream ends."""
        if self.each_event:
            return items
        self._held.extend(items)
        if not self._held or not _is_terminal(self._held[-1]):
            return []
        ready, self._held = self._held, []
        return ready

    def __aiter__(self):
        return self._events()

    async def _events(self) -> AsyncIterator[Generation | SampleResult]:
        while True:
            for item in await self.queue.get():
                if item is _DONE:
                    return
                if isinstance(item, GenerationError):
                    raise EngineFailure(item.message)
                yield item


@dataclass(slots=True)
class _Row:
    """Host-side bookkeeping for one live sequence (one sample of a request)."""

    stream: GenerationStream
    sample: int
    position: int  # absolute position of the next token to draw
    end: int  # generation stops before this position
    last_token_at: float = 0.0
    tail: bytes = b""  # recent output, for stop sequences

    @classmethod
    def first_token_of(cls, stream: GenerationStream, sample: int) -> "_Row":
        """A row about to draw the first token after its request's prompt."""
        req = stream.request
        return cls(stream, sample, len(req.prompt), len(req.prompt) + req.max_new_tokens)

    @property
    def start(self) -> int:
        """Position of the sample's first generated token."""
        return len(self.stream.request.prompt)

    def finish_reason(self, token: int) -> str | None:
        stops = self.stream.request.stop
        if stops:
            self.tail = (self.tail + bytes([token]))[-max(map(len, stops)):]
            if any(self.tail.endswith(s) for s in stops):
                return "stop"
        return "length" if self.position + 1 >= self.end else None


@dataclass
class _Slots:
    """Preallocated per-row tensors, (max_batch, ...) each."""

    logits: torch.Tensor  # (N, V) next-token logits per row
    position: torch.Tensor  # (N,) position being drawn
    forced: torch.Tensor  # (N, max_len) known token per position, -1 if free
    generated: torch.Tensor  # (N, max_len) token drawn at each position, for SampleResults
    logprobs: torch.Tensor  # (N, max_len) its log-probability, written while a row asks for them
    sampling: BatchSampling  # (N,) each
    state: object = field(default=None)  # ModelState

    def row_tensors(self) -> list[torch.Tensor]:
        s = self.sampling
        return [self.logits, self.position, self.forced, self.generated, self.logprobs,
                s.temperature, s.top_k, s.top_p, s.seed]

    def copy_row(self, src: int, dst: int) -> None:
        for t in self.row_tensors():
            t[dst] = t[src]
        self.state.copy_rows(src, dst)

    def batch_sampling(self, n: int) -> BatchSampling:
        s = self.sampling
        return BatchSampling(s.temperature[:n], s.top_k[:n], s.top_p[:n], s.seed[:n])


class Engine:
    def __init__(self, name: str, model: Transformer, info: dict, limits: EngineLimits, metrics: Metrics):
        self.name = name
        self.model = model.eval()
        self.info = info
        self.limits = limits
        self.metrics = metrics
        self.state_bytes_per_sequence = model.state_bytes_per_sequence()
        self._waiting: deque[GenerationStream] = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._ready = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rows: list[_Row] = []
        self._slots: _Slots | None = None
        self._decoder: EagerDecoder | None = None
        self._after_bos: tuple[ModelState, torch.Tensor] | None = None  # see _prefill_bos
        self._start_error: Exception | None = None
        self._scoring = 0  # score() calls in flight, bounded like the waiting queue
        self._admitting = 0  # sequences taken off the queue whose rows are not registered yet
        metrics.register_model(name, self.attention)

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
        return self._decoder is not None and self._decoder.graphed

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        """Sequences queued: a request for n samples waits for n slots."""
        return sum(stream.request.n for stream in list(self._waiting))

    def _free_slots(self) -> int:
        """Slots neither running nor promised to a queued request."""
        return max(0, self.limits.max_batch - self.running - self.waiting - self._admitting)

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
        self._validate(request)
        stream = GenerationStream(request, asyncio.get_running_loop(), each_event)
        with self._lock:
            self._drop_cancelled_waiting()
            if len(self._waiting) >= self.limits.max_waiting and request.n > self._free_slots():
                raise QueueFull(f"model {self.name!r} has {len(self._waiting)} requests waiting, the limit; retry later")
            self._waiting.append(stream)
        self.metrics.queue(self.name, self.attention, self.running, self.waiting)
        self._wakeup.set()
        return stream

    async def score(self, tokens: list[int]) -> list[float]:
        """Log-probability of each token given those before it (the first given BOS)."""
        if not 1 <= len(tokens) <= self.config.max_len:
            raise ValueError(f"can score 1 to {self.config.max_len} tokens, got {len(tokens)}")
        if self._scoring >= max(1, self.limits.max_waiting):
            raise QueueFull(f"model {self.name!r} is scoring {self._scoring} prompts, the limit; retry later")
        self._scoring += 1  # event-loop side only: no lock needed
        try:
            return await asyncio.to_thread(self._score, tokens)
        finally:
            self._scoring -= 1

    def _validate(self, request: GenerationRequest) -> None:
        max_len = self.config.max_len
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if len(request.prompt) + request.max_new_tokens > max_len:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                             f"exceeds this model's max_len of {max_len}")
        if not 1 <= request.n <= self.limits.max_batch:
            raise ValueError(f"n must be between 1 and {self.limits.max_batch} (this server's max batch), got {request.n}")
        if any(not 0 <= t < BOS_TOKEN for t in request.prompt):
            raise ValueError("prompt tokens must be in 0..255")

    # -- worker thread --------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            try:
                self._slots = self._allocate()
                self._after_bos = self._prefill_bos()
                self._decoder = make_decoder(self.model, self._slots.state, self.limits.cuda_graphs)
            except (RuntimeError, MemoryError) as exc:  # out of memory: report, do not hang start()
                self._start_error = exc
                self._ready.set()
                return
            self._ready.set()
            while not self._stopping:
                try:
                    self._admit()
                    if self._rows:
                        self._step()
                    else:
                        self._idle()
                except Exception as exc:  # keep serving: fail what was running, not the engine
                    log.exception("engine %s failed a step", self.name)
                    self._fail_running(f"internal error while generating: {exc}")
            self._fail_all("server is shutting down")

    def _allocate(self) -> _Slots:
        n, cfg, device = self.limits.max_batch, self.config, self.model.device
        sampling = BatchSampling(torch.ones(n, device=device), torch.zeros(n, dtype=torch.long, device=device),
                                 torch.ones(n, device=device), torch.zeros(n, dtype=torch.long, device=device))
        return _Slots(logits=torch.zeros(n, cfg.vocab_out, device=device),
                      position=torch.zeros(n, dtype=torch.long, device=device),
                      forced=torch.full((n, cfg.max_len), -1, dtype=torch.long, device=device),
                      generated=torch.zeros(n, cfg.max_len, dtype=torch.long, device=device),
                      logprobs=torch.zeros(n, cfg.max_len, device=device),
                      sampling=sampling, state=self.model.new_state(n))

    def _idle(self) -> None:
        self.metrics.idle(self.name, self.attention)  # let the rate gauges decay, batch size 0
        self.metrics.queue(self.name, self.attention, 0, self.waiting)
        self._wakeup.wait(IDLE_WAKEUP_SECONDS)
        self._wakeup.clear()

    def _drop_cancelled_waiting(self) -> None:
        """Remove requests whose clients left while queued (call with the lock held)."""
        gone = [s for s in self._waiting if s.cancelled]
        if gone:  # runs every step: nothing to hand over in the usual case
            for stream in gone:
                self._waiting.remove(stream)
            self._deliver({s: [_DONE] for s in gone})

    def _admit(self) -> None:
        """Move every waiting request that fits into the batch; prompts of one length prefill together."""
        with self._lock:
            self._drop_cancelled_waiting()
            taken, free = [], self.limits.max_batch - len(self._rows)
            while self._waiting and self._waiting[0].request.n <= free:
                taken.append(self._waiting.popleft())
                free -= taken[-1].request.n
            if not taken:  # the usual step: nothing to admit
                return
            self._admitting = sum(s.request.n for s in taken)  # still promised: submit must not hand them out
        try:
            self._prefill_groups(taken)
        finally:
            self._admitting = 0

    def _prefill_groups(self, taken: list[GenerationStream]) -> None:
        """Prefill the taken requests, one forward per prompt length; a failed group fails only itself."""
        gone = [s for s in taken if s.cancelled]
        if gone:
            self._deliver({s: [_DONE] for s in gone})
        groups: dict[int, list[GenerationStream]] = defaultdict(list)
        for stream in taken:
            if not stream.cancelled:
                groups[len(stream.request.prompt)].append(stream)
        for streams in groups.values():
            try:
                self._prefill(streams)
            except Exception as exc:
                log.exception("prefill failed")
                self._deliver({s: [GenerationError(s.request.request_id, f"prefill failed: {exc}")] for s in streams})

    def _prefill(self, streams: list[GenerationStream]) -> None:
        """One forward over prompts of equal length, into rows [first, first + len(streams));
        each request's further samples then copy its row. Rows go live only once all is written,
        so a failure leaves none of the group decoding."""
        slots, first, count = self._slots, len(self._rows), len(streams)
        slots.logits[first:first + count] = self._run_prompts(streams, slots.state.slice(first, first + count))
        rows = []
        for row, stream in enumerate(streams, start=first):
            self._fill_row(row, stream.request)
            rows.append(_Row.first_token_of(stream, 0))
        for row, stream in enumerate(streams, start=first):
            for i in range(1, stream.request.n):
                slots.copy_row(row, first + len(rows))
                slots.sampling.seed[first + len(rows)] = stream.request.sampling.seed + i
                rows.append(_Row.first_token_of(stream, i))
        self._rows.extend(rows)
        for stream in streams:
            stream.live_rows = stream.request.n

    def _run_prompts(self, streams: list[GenerationStream], row_state: ModelState) -> torch.Tensor:
        """Prefill one row per stream with BOS + its prompt -> (count, V) next-token logits.
        Empty prompts (e.g. images with no known first pixel) copy the state after BOS alone,
        computed once at start-up, instead of running the model."""
        if not streams[0].request.prompt:
            after_bos, logits = self._after_bos
            row_state.write_rows(range(len(streams)), after_bos)
            return logits
        row_state.reset_rows(range(len(streams)))
        tokens = torch.tensor([[BOS_TOKEN, *s.request.prompt] for s in streams], device=self.model.device)
        logits, _ = self.model(tokens, row_state)  # (count, P + 1, V)
        return logits[:, -1].float()

    def _prefill_bos(self) -> tuple[ModelState, torch.Tensor]:
        """The state after BOS alone and its next-token logits (1, V): where every empty prompt starts."""
        state = self.model.new_state(1)
        logits, _ = self.model(torch.tensor([[BOS_TOKEN]], device=self.model.device), state)
        return state, logits[:, -1].float()

    def _fill_row(self, row: int, req: GenerationRequest) -> None:
        """A new sequence's per-row slots: position, known tokens, sampling parameters."""
        slots, s = self._slots, self._slots.sampling
        slots.position[row] = len(req.prompt)
        slots.forced[row] = -1
        if req.forced:  # one indexed write, not one per known pixel
            positions, values = zip(*req.forced.items())
            slots.forced[row, list(positions)] = torch.tensor(values, device=slots.forced.device)
        s.temperature[row], s.top_k[row], s.top_p[row] = req.sampling.temperature, req.sampling.top_k, req.sampling.top_p
        s.seed[row] = req.sampling.seed

    def _step(self) -> None:
        slots, n = self._slots, len(self._rows)
        position = slots.position[:n]
        logits = slots.logits[:n]
        tokens = sample(logits, slots.batch_sampling(n), position)
        tokens = force_tokens(tokens, slots.forced[:n].gather(1, position[:, None])[:, 0])
        slots.generated[:n].scatter_(1, position[:, None], tokens[:, None])
        done, emitted = self._emit(tokens.tolist(), self._logprobs(logits, tokens, position))
        position += 1
        self._drop_rows(done, tokens)
        live = len(self._rows)
        if live:  # rows [0, live) hold the live sequences, so one decode step over them
            slots.logits[:live] = self._decoder(tokens[:live])
        self.metrics.step(self.name, self.attention, batch=n, tokens=emitted,
                          state_bytes=slots.state.nbytes_in_use(live))
        self.metrics.queue(self.name, self.attention, live, self.waiting)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, position: torch.Tensor) -> list[float] | None:
        """The drawn tokens' log-probabilities, only while some row asks: kept by position for
        SampleResults and returned for Generation events."""
        if not any(row.stream.request.logprobs for row in self._rows):
            return None
        logprobs = token_logprobs(logits, tokens)  # (n,)
        self._slots.logprobs[:len(tokens)].scatter_(1, position[:, None], logprobs[:, None])
        return logprobs.tolist()

    def _emit(self, tokens: list[int], logprobs: list[float] | None) -> tuple[list[int], int]:
        """Turn one step's tokens into events and results; return rows that finished and tokens drawn."""
        now = time.monotonic()
        outbox: dict[GenerationStream, list] = defaultdict(list)
        done: list[int] = []
        previous: dict[float, int] = {}  # time of a row's previous token -> rows (all alike but new rows)
        emitted = 0
        for i, row in enumerate(self._rows):
            stream = row.stream
            if stream.cancelled:
                done.append(i)
                continue
            reason = row.finish_reason(tokens[i])
            if stream.each_event:
                outbox[stream].append(Generation(stream.request.request_id, row.sample, row.position, tokens[i],
                                                 logprobs[i] if stream.request.logprobs else None, reason))
            self._time_token(row, now, previous)
            row.position += 1
            emitted += 1
            if reason is not None:
                done.append(i)
                if not stream.each_event:
                    outbox[stream].append(self._result(i, row, reason))
        for then, rows in previous.items():
            self.metrics.inter_tokens(self.name, self.attention, now - then, rows)
        for i in done:
            stream = self._rows[i].stream
            stream.live_rows -= 1
            if stream.live_rows == 0:
                outbox[stream].append(_DONE)
        self._deliver(outbox)
        return done, emitted

    def _result(self, i: int, row: _Row, reason: str) -> SampleResult:
        """A finished row's tokens (and log-probabilities), read from the slots in one go."""
        request, span = row.stream.request, slice(row.start, row.position)
        logprobs = self._slots.logprobs[i, span].tolist() if request.logprobs else None
        return SampleResult(request.request_id, row.sample, row.start, self._slots.generated[i, span].tolist(),
                            logprobs, reason)

    def _time_token(self, row: _Row, now: float, previous: dict[float, int]) -> None:
        """Time to first token goes to its histogram at once; later tokens are counted by the
        time of their previous one, so a step records its inter-token gaps in one or two updates."""
        stream = row.stream
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.metrics.first_token(self.name, self.attention, now - stream.submitted_at)
        elif row.last_token_at:
            previous[row.last_token_at] = previous.get(row.last_token_at, 0) + 1
        row.last_token_at = now

    def _drop_rows(self, done: list[int], tokens: torch.Tensor) -> None:
        """Remove finished rows, moving the last live row into each hole."""
        for i in sorted(done, reverse=True):
            last = len(self._rows) - 1
            if i != last:
                self._slots.copy_row(last, i)
                tokens[i] = tokens[last]
                self._rows[i] = self._rows[last]
            self._rows.pop()

    def _deliver(self, outbox: dict[GenerationStream, list]) -> None:
        """Hand events to their streams' event loops: one thread hop per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream, items in outbox.items():
            ready = stream.release(items)
            if ready:
                by_loop[stream.loop].append((stream, ready))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass

    def _fail_running(self, message: str) -> None:
        streams = list(dict.fromkeys(r.stream for r in self._rows))
        self._rows.clear()
        self._deliver({s: [GenerationError(s.request.request_id, message)] for s in streams})
        self.metrics.queue(self.name, self.attention, 0, self.waiting)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        self._deliver({s: [GenerationError(s.request.request_id, message)] for s in waiting})
        self._fail_running(message)

    def _score(self, tokens: list[int]) -> list[float]:
        with torch.inference_mode():
            x = torch.tensor([tokens], device=self.model.device)
            logits, _ = self.model(with_bos(x))
            return token_logprobs(logits[0], x[0]).tolist()


def _put_all(batch: list[tuple[GenerationStream, list]]) -> None:
    for stream, items in batch:
        stream.queue.put_nowait(items)
