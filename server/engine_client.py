"""The API process's side of an engine process (`--engine-process`; server/engine_process.py has the
other side and the protocol): `EngineClient` stands in for an `Engine`, so handlers use either alike."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing

from model.transformer import Transformer

from .engine import EngineFacts, EngineLimits
from .engine_process import EngineSpec, StartedFacts, rebuild_error, serve_engine
from .metrics import Metrics
from .streams import EngineFailure, GenerationStream, LoopSink, call_in_loop, hand_over, is_terminal, settle
from .types import GenerationError, GenerationRequest, PromptScores
from .validation import check_generation, check_scoring

if TYPE_CHECKING:
    from model.compiled_decode import CompileGate

log = logging.getLogger("rnnserve.engine_client")
STOP_SECONDS = 30.0  # an engine process told to stop gets this long before it is killed
START_SECONDS = 300.0  # spawning, importing torch and allocating the slots
FORWARDED_METRICS = frozenset({"record_step", "idle", "queue", "state_allocated"})  # what the engine records


class RemoteStream(GenerationStream):
    """A stream whose engine is in another process: cancelling it tells that process."""

    def __init__(self, request: GenerationRequest, sink: LoopSink, client: "EngineClient", key: int):
        super().__init__(request, sink, each_event=True)  # the engine process holds events back, not this side
        self.client, self.key = client, key

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.client.cancel(self.key)


class EngineClient(EngineFacts):
    """The API process's side of an engine process: what handlers use in place of an `Engine`."""

    def __init__(self, name: str, model: Transformer, info: dict, limits: EngineLimits, metrics: Metrics,
                 threads: int | None = None, compile_gate: CompileGate | None = None):
        self.name, self.model, self.info, self.limits = name, model.eval(), info, limits
        self.state_bytes_per_sequence = model.state_bytes_per_sequence()  # at max_len
        self.state_bytes_allocated = 0  # known once started
        self.cuda_graphs = False  # known once started
        self.compiled_decode = False  # true once the engine process has compiled its decode steps
        self.metrics = metrics.for_model(name, model.config.attention, images=model.config.task == "mnist")
        self._threads = threads
        self._compile_gate = compile_gate  # server/compile_gate.py: the engines compile in turn
        self._process: torch.multiprocessing.Process | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._reaping = threading.Lock()
        self._lock = threading.Lock()  # the two tables below: the event loop adds, the reader thread removes
        self._streams: dict[int, RemoteStream] = {}
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # answers awaited
        self._keys = itertools.count()
        self._compiled = threading.Event()
        self._alive = False
        self._stopping = False

    @property
    def ready(self) -> bool:
        return self._alive and not self._stopping

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        return self._compiled.wait(timeout)

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine process and wait until its slots are allocated; EngineFailure if it cannot start."""
        context = torch.multiprocessing.get_context("spawn")  # fork would copy a process with threads running
        ours, theirs = context.Pipe()
        spec = EngineSpec(self.name, self.model, self.info, self.limits, self._threads,
                          logging.getLogger("rnnserve").getEffectiveLevel(), self._compile_gate)
        self._process = context.Process(target=serve_engine, args=(theirs, spec), name=f"engine-{self.name}")
        self._process.start()
        theirs.close()
        self._conn = ours
        started = self._first_message()
        self.state_bytes_allocated, self.cuda_graphs = started.state_bytes_allocated, started.cuda_graphs
        self._alive = True
        self._reader = threading.Thread(target=self._read, name=f"engine-{self.name}-reader", daemon=True)
        self._reader.start()
        log.info("model %s: engine process %d started", self.name, self._process.pid)

    def _first_message(self) -> StartedFacts:
        assert self._conn is not None and self._process is not None
        while True:
            message = self._next_start_message()
            if message[0] != "metric":  # the engine records its allocated state before it says it started
                break
            self._record(*message[1:])
        if message[0] == "started":
            return message[1]
        self._end_process()
        raise EngineFailure(f"model {self.name!r}: the engine process failed to start: {message[1]}")

    def _next_start_message(self) -> tuple:
        assert self._conn is not None and self._process is not None
        try:
            if self._conn.poll(START_SECONDS):
                return self._conn.recv()
        except (EOFError, OSError):
            return ("failed", f"it exited with code {self._end_process()} (its log above says why)")
        return ("failed", f"it did not start within {START_SECONDS:.0f} s")

    def stop(self) -> None:
        if self._process is None:
            return
        self._stopping = True
        self._send(("stop",))
        self._end_process()
        if self._reader is not None:
            self._reader.join()

    def _end_process(self) -> int | None:
        """Wait for the engine process to exit (killed past STOP_SECONDS); its exit code. One thread at a
        time: two threads reaping one child race, and the loser would see it alive after it has exited."""
        assert self._process is not None
        with self._reaping:
            self._process.join(STOP_SECONDS)
            if self._process.exitcode is None:
                log.warning("model %s: engine process did not exit in %.0f s; killing it", self.name, STOP_SECONDS)
                self._process.kill()
                self._process.join()
        return self._process.exitcode

    # -- requests (event loop) --------------------------------------------------
    async def enqueue(self, request: GenerationRequest, each_event: bool = True) -> GenerationStream:
        """Queue a request in the engine process; raises QueueFull / InvalidRequest like `Engine.submit`."""
        check_generation(request, self.name, self.config.max_len, self.limits.max_batch)
        loop = asyncio.get_running_loop()
        key, future = next(self._keys), loop.create_future()
        stream = RemoteStream(request, LoopSink(loop), self, key)
        with self._lock:  # before sending: its events may come before its acceptance
            self._check_alive()
            self._streams[key] = stream
            self._pending[key] = (loop, future)
        self._send(("submit", key, request, each_event))
        try:
            await future
        except BaseException:  # refused, or the client went away meanwhile
            stream.cancel()
            raise
        return stream

    async def score(self, tokens: list[int], top: int = 0) -> PromptScores:
        check_scoring(tokens, self.name, self.config.max_len)
        loop = asyncio.get_running_loop()
        key, future = next(self._keys), loop.create_future()
        with self._lock:
            self._check_alive()
            self._pending[key] = (loop, future)
        self._send(("score", key, tokens, top))
        return await future

    def _check_alive(self) -> None:
        """(With the lock held.) Refuse work once the engine process is gone: nothing would answer it."""
        if not self._alive:
            raise EngineFailure(f"model {self.name!r}: its engine process is not running")

    def cancel(self, key: int) -> None:
        with self._lock:
            running = self._streams.pop(key, None) is not None
        if running:
            self._send(("cancel", key))

    def _send(self, message: tuple) -> None:
        """Send to the engine process; if it is gone, what waits on it fails (the reader sees it exit)."""
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # broken pipe, or closed
            if not self._stopping:
                log.warning("model %s: cannot reach the engine process: %s", self.name, exc)

    # -- reader thread ------------------------------------------------------------
    def _read(self) -> None:
        """Dispatch the engine process's messages until it exits; then fail whatever still waits on it."""
        assert self._conn is not None and self._process is not None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(message)
            except Exception:
                log.exception("model %s: bad message from the engine process: %.200r", self.name, message)
        with self._lock:
            self._alive = False
        code = self._end_process()
        reason = ("the server is shutting down" if self._stopping else
                  f"its engine process exited unexpectedly (exit code {code})")
        self._fail_everything(f"model {self.name!r}: {reason}")

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "events":
            self._hand_over(message[1])
        elif kind == "metric":
            self._record(message[1], message[2])
        elif kind in ("accepted", "refused", "scored"):
            self._answer(kind, *message[1:])
        elif kind == "compiled":
            self.compiled_decode = message[1]
            self._compiled.set()
        elif kind == "batch":
            for each in message[1]:
                self._dispatch(each)
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _hand_over(self, batch: list[tuple[int, list]]) -> None:
        pairs = []
        with self._lock:
            for key, items in batch:
                stream = self._streams.get(key)
                if stream is None:  # cancelled on this side: nobody reads it
                    continue
                if is_terminal(items[-1]):
                    del self._streams[key]
                pairs.append((stream, items))
        hand_over(pairs)

    def _record(self, method: str, args: tuple) -> None:
        if method not in FORWARDED_METRICS:
            raise ValueError(f"unknown metric call {method!r}")
        getattr(self.metrics, method)(*args)

    def _answer(self, kind: str, key: int, *rest) -> None:
        with self._lock:
            waiting = self._pending.pop(key, None)
            if kind == "refused":
                self._streams.pop(key, None)
        if waiting is None:  # failed already: the engine process was going away
            return
        loop, future = waiting
        if kind == "scored":
            result, error = rest
        else:  # accepted: no error; refused: why
            result, error = None, (rest[0] if kind == "refused" else None)
        call_in_loop(loop, settle, future, result, rebuild_error(error))

    def _fail_everything(self, message: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        hand_over([(s, [GenerationError(s.request.request_id, message)]) for s in streams])
        for loop, future in pending:
            call_in_loop(loop, settle, future, None, EngineFailure(message))
        self._compiled.set()  # nothing left to wait for
