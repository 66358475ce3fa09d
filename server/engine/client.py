"""The API process's side of an engine process (`--engine-process`; server/engine/process.py has the
other side, server/engine/messages.py the protocol): `EngineClient` stands in for an `Engine`, so handlers
use either alike. It records each pass's figures on arrival, then hands the pass's events on."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing

from model.transformer import Transformer
from model.io.vocabulary import Vocabulary, byte_vocabulary

from server.engine.core import EngineFacts, EngineLimits
from server.engine import messages as msg
from server.engine.output import record_gauges
from server.engine.process import EngineSpec, rebuild_error, serve_engine
from server.engine.types import StepStats
from server.metrics import Metrics
from server.engine.streams import (
    Event,
    EventTarget,
    ENGINE_RESTARTING,
    SHUTTING_DOWN,
    EngineFailure,
    GenerationStream,
    LoopSink,
    call_in_loop,
    hand_over,
    is_terminal,
    settle,
)
from server.engine.types import GenerationError, GenerationRequest, PromptScores
from server.engine.validation import check_generation, check_scoring
from server.engine.watchdog import Heartbeat

if TYPE_CHECKING:
    from model.decode.compiled.background import CompileGate

log = logging.getLogger("rnnserve.engine_client")
STOP_SECONDS = 30.0  # an engine process told to stop gets this long before it is killed
START_SECONDS = 300.0  # spawning, importing torch and allocating the slots


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

    def __init__(
        self,
        name: str,
        model: Transformer,
        info: dict[str, Any],
        limits: EngineLimits,
        metrics: Metrics,
        threads: int | None = None,
        compile_gate: CompileGate | None = None,
        vocabulary: Vocabulary | None = None,
        worker: int = 0,
    ):
        self.name, self.model, self.info, self.limits = name, model.eval(), info, limits
        self.vocabulary = vocabulary or byte_vocabulary()
        self.state_bytes_per_sequence = model.state_bytes_per_sequence()  # at max_len
        self.state_bytes_allocated = 0  # known once started
        self.cuda_graphs = False  # known once started
        self.compiled_decode = False  # true once the engine process has compiled its decode steps
        self.cpu_route: str | None = None  # what its steps run on, as the engine process last said
        self.worker = worker  # which of the model's engine processes (server/engine/pool.py): its gauges' share
        self.metrics = metrics.for_model(name, model.config.attention, model.config.task == "mnist", worker)
        self.threads = threads or torch.get_num_threads()  # the engine process's intra-op threads
        self._compile_gate = compile_gate  # server/engine/compile_gate.py: the engines compile in turn
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._reaping = threading.Lock()
        self._lock = threading.Lock()  # the two tables below: the event loop adds, the reader thread removes
        self._streams: dict[int, RemoteStream] = {}
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}  # answers awaited
        self._keys = itertools.count()
        self._compiled = threading.Event()
        self._alive = self._stopping = False
        self._stopped = threading.Event()
        self._lifecycle = threading.Lock()  # starting (or restarting) against stopping
        self._started_at = self._next_try_at = 0.0  # time.monotonic(): the last start, the next restart attempt
        self._backoff, self.restarts = Backoff(), 0
        self.heartbeat = Heartbeat()  # the engine process's loop stamps it (server/engine/watchdog.py)
        self._hung_for: float | None = None  # the watchdog found it silent this long with work: being killed

    @property
    def ready(self) -> bool:
        return self._alive and not self._stopping and self._hung_for is None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def rows_in_flight(self) -> int:
        """What a pool balances: decode rows the requests sent to this process hold or wait for, and a row for
        each score it has not answered yet."""
        with self._lock:
            scores = sum(1 for key in self._pending if key not in self._streams)
            return scores + sum(stream.request.rows for stream in self._streams.values())

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        return self._compiled.wait(timeout)

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine process and wait until its slots are allocated; EngineFailure if it cannot start."""
        with self._lifecycle:
            self._spawn()

    def _spawn(self, restart: bool = False) -> None:
        self.compiled_decode, self._compiled = False, threading.Event()  # a new process compiles anew
        self.cpu_route = None  # until the new process says
        context = torch.multiprocessing.get_context("spawn")  # fork would copy a process with threads running
        ours, theirs = context.Pipe()
        spec = EngineSpec(
            self.name,
            self.model,
            self.info,
            self.limits,
            self.threads,
            logging.getLogger("rnnserve").getEffectiveLevel(),
            self._compile_gate,
            self.vocabulary,
            self.heartbeat,
            self.worker,
        )
        self._hung_for = None
        self.heartbeat.beat()  # the new process's silence counts from its start
        process = context.Process(target=serve_engine, args=(theirs, spec), name=f"engine-{self.name}-{self.worker}")
        self._process = process
        process.start()
        theirs.close()
        self._conn = ours
        started = self._first_message()
        self.state_bytes_allocated, self.cuda_graphs = started.state_bytes_allocated, started.cuda_graphs
        self.cpu_route = started.cpu_route
        self._started_at = time.monotonic()
        if restart:  # counted before it is ready: whoever sees it ready sees it counted
            self.restarts += 1
            self.metrics.engine_restarted()
        self._alive = True
        self._reader = threading.Thread(
            target=self._read, args=(self._conn, process), name=f"engine-{self.name}-reader", daemon=True
        )
        self._reader.start()
        log.info("model %s: engine process %d started", self.name, process.pid)

    def _first_message(self) -> msg.Started:
        assert self._conn is not None and self._process is not None
        while True:
            message = self._next_start_message()
            if not isinstance(message, msg.GaugesNow):  # the engine reports its allocated state before it starts
                break
            record_gauges(self.metrics, message.gauges)
        if isinstance(message, msg.Started):
            return message
        self._end_process()
        why = message.message if isinstance(message, msg.StartFailed) else f"it sent {type(message).__name__} first"
        raise EngineFailure(f"model {self.name!r}: the engine process failed to start: {why}")

    def _next_start_message(self) -> object:
        assert self._conn is not None and self._process is not None
        try:
            if self._conn.poll(START_SECONDS):
                return self._conn.recv()
        except (EOFError, OSError):
            return msg.StartFailed(describe_early_exit(self._end_process()))
        return msg.StartFailed(f"it did not start within {START_SECONDS:.0f} s")

    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()  # a restart waiting out its back-off gives up
        with self._lifecycle:
            if self._process is None:
                return
            self._send(msg.Stop())
            self._end_process()
            reader = self._reader
        if reader is not None:
            reader.join()

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

    def _restart(self) -> None:
        """(A thread of its own.) Start a new engine process after a back-off that doubles while the
        engine keeps dying young, so a model that cannot run does not spin the CPU."""
        delay = self._backoff.next_delay(time.monotonic() - self._started_at)
        while not self._stopped.wait(self._wait_until_next_try(delay)):
            with self._lifecycle:
                if self._stopping:
                    return
                try:
                    self._spawn(restart=True)
                except EngineFailure as exc:
                    delay = self._backoff.next_delay(0.0)
                    log.error("model %s: restarting the engine failed (%s); next try in %.1f s", self.name, exc, delay)
                    continue
            log.info("model %s: engine restarted (restart %d); serving again", self.name, self.restarts)
            return

    def _wait_until_next_try(self, delay: float) -> float:
        self._next_try_at = time.monotonic() + delay
        return delay

    def retry_after_seconds(self) -> int:
        """Until the next restart attempt (at least a second: a start takes seconds)."""
        return max(1, math.ceil(self._next_try_at - time.monotonic()))

    # -- the watchdog's calls (server/engine/watchdog.py; its thread) ----------------------------------------
    def has_work(self) -> bool:
        with self._lock:
            return self._alive and not self._stopping and bool(self._streams or self._pending)

    def hung(self, silent_seconds: float) -> None:
        """Kill the silent engine process: the reader sees it die, fails its requests with 503
        engine_restarting and restarts it, as for any engine process that dies."""
        with self._lock:
            if not self._alive or self._hung_for is not None:
                return
            self._hung_for = silent_seconds
            in_flight = len(self._streams) + len(self._pending)
        process = self._process
        assert process is not None
        log.error(
            "model %s: its engine process %d (worker %d) has made no progress for %.1f s with %d request(s) in "
            "flight; killing it (SIGKILL) to restart it",
            self.name,
            process.pid,
            self.worker,
            silent_seconds,
            in_flight,
        )
        process.kill()

    # -- requests (event loop) --------------------------------------------------
    async def enqueue(self, request: GenerationRequest, each_event: bool = True) -> GenerationStream:
        """Queue a request in the engine process; raises QueueFull / InvalidRequest like `Engine.submit`."""
        check_generation(request, self.name, self.config, self.limits.max_batch)
        loop = asyncio.get_running_loop()
        key, future = next(self._keys), loop.create_future()
        stream = RemoteStream(request, LoopSink(loop), self, key)
        with self._lock:  # before sending: its events may come before its acceptance
            self._check_alive()
            self._streams[key] = stream
            self._pending[key] = (loop, future)
        self._send(msg.Submit(key, request, each_event))
        try:
            await future
        except BaseException:  # refused, or the client went away meanwhile
            stream.cancel()
            raise
        return stream

    async def score(self, tokens: list[int], top: int = 0) -> PromptScores:
        check_scoring(tokens, self.name, self.config)
        loop = asyncio.get_running_loop()
        key, future = next(self._keys), loop.create_future()
        with self._lock:
            self._check_alive()
            self._pending[key] = (loop, future)
        self._send(msg.Score(key, tokens, top))
        scores: PromptScores = await future
        return scores

    def _check_alive(self) -> None:
        """(With the lock held.) Refuse work once the engine process is gone: nothing would answer it."""
        if not self._alive:
            code = SHUTTING_DOWN if self._stopping else ENGINE_RESTARTING
            raise EngineFailure(f"model {self.name!r}: its engine process is not running", code)

    def cancel(self, key: int) -> None:
        with self._lock:
            running = self._streams.pop(key, None) is not None
        if running:
            self._send(msg.Cancel(key))

    def _send(self, message: object) -> None:
        """Send to the engine process; if it is gone, what waits on it fails (the reader sees it exit)."""
        try:
            with self._send_lock:
                if self._conn is None:
                    raise ValueError("no engine process was started")
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # broken pipe, or closed
            if not self._stopping:
                log.warning("model %s: cannot reach the engine process: %s", self.name, exc)

    # -- reader thread ------------------------------------------------------------
    def _read(self, conn: Connection, process: torch.multiprocessing.Process) -> None:
        """Dispatch the engine process's messages until it exits; then fail whatever still waits on it,
        and, unless the server is stopping, start it again. The process's sentinel is watched beside the
        pipe: a child it left behind could hold the pipe open after it died."""
        while True:
            ready = wait([conn, process.sentinel])
            if conn not in ready:  # dead, and everything it sent has been read
                break
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(message)
            except Exception:
                log.exception("model %s: bad message from the engine process: %.200r", self.name, message)
        with self._lock:
            self._alive = False
        code = self._end_process()
        if self._stopping:
            self._fail_everything(f"model {self.name!r}: the server is shutting down", SHUTTING_DOWN)
            return
        why = describe_exit(code)
        if self._hung_for is not None:
            why += f" by the watchdog: no progress for {self._hung_for:.1f} s"
        log.error(
            "model %s: its engine process %d died (%s) with %d request(s) in flight; they fail with 503 "
            "engine_restarting and the engine restarts",
            self.name,
            process.pid,
            why,
            len(self._streams) + len(self._pending),
        )
        self.metrics.engine_gone()  # before the clients hear of it: they find the gauges at zero
        self.state_bytes_allocated = 0
        self._fail_everything(
            f"model {self.name!r}: its engine process died ({why}); it is restarting, retry shortly",
            ENGINE_RESTARTING,
        )
        threading.Thread(target=self._restart, name=f"engine-{self.name}-restart", daemon=True).start()

    def _record_steps(self, passes: list[StepStats]) -> None:
        for stats in passes:
            self.metrics.record_step(stats)

    def _dispatch(self, message: object) -> None:
        match message:
            case msg.Step(passes, events):
                self._record_steps(passes)  # first: a client that has its answer finds the step counted
                self._hand_over(events)
            case msg.Events(events):
                self._hand_over(events)
            case msg.GaugesNow(gauges, passes):
                self._record_steps(passes)
                record_gauges(self.metrics, gauges)
            case msg.Accepted(key, gauges):
                record_gauges(self.metrics, gauges)
                self._answer(key, None)
            case msg.Refused(key, error):
                self._answer(key, None, error, refused=True)
            case msg.Scored(key, result, error):
                self._answer(key, result, error)
            case msg.Compiled(compiled, cpu_route):
                self.compiled_decode, self.cpu_route = compiled, cpu_route
                self._compiled.set()
            case _:
                raise ValueError(f"unknown message {type(message).__name__}")

    def _hand_over(self, batch: msg.TaggedEvents) -> None:
        pairs: list[tuple[EventTarget, list[Event]]] = []
        with self._lock:
            for key, items in batch:
                stream = self._streams.get(key)
                if stream is None:  # cancelled on this side: nobody reads it
                    continue
                if is_terminal(items[-1]):
                    del self._streams[key]
                pairs.append((stream, items))
        hand_over(pairs)

    def _answer(
        self, key: int, result: object, error: msg.ErrorDescription | None = None, refused: bool = False
    ) -> None:
        """Settle what waits on `key`: a submit (accepted, or refused with why) or a score."""
        with self._lock:
            waiting = self._pending.pop(key, None)
            if refused:
                self._streams.pop(key, None)
        if waiting is None:  # failed already: the engine process was going away
            return
        loop, future = waiting
        call_in_loop(loop, settle, future, result, rebuild_error(error))

    def _fail_everything(self, message: str, code: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        hand_over([(s, [GenerationError(s.request.request_id, message, code)]) for s in streams])
        for loop, future in pending:
            call_in_loop(loop, settle, future, None, EngineFailure(message, code))
        self._compiled.set()  # nothing left to wait for


def describe_exit(code: int | None) -> str:
    """An exit code as a person reads it: negative codes are the signal that ended the process."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def describe_early_exit(code: int | None) -> str:
    """Why an engine process ended before it started: a signal, which it could not log about (SIGKILL from an
    operator or the kernel's OOM killer), or an exit code, which follows its own log lines."""
    if code is not None and code < 0:
        hint = " (an operator, or the kernel's OOM killer: see `dmesg`)" if code == -signal.SIGKILL else ""
        return f"it was {describe_exit(code)}{hint} before it had started"
    return f"it exited with code {code} before it had started (its log above says why)"


class Backoff:
    """Delays between restarts: FIRST, doubled while the engine dies within HEALTHY_SECONDS of starting,
    at most LONGEST; back to FIRST after an engine that ran well."""

    FIRST, LONGEST, HEALTHY_SECONDS = 0.5, 30.0, 60.0

    def __init__(self) -> None:
        self.delay = 0.0

    def next_delay(self, lived_seconds: float) -> float:
        young = lived_seconds < self.HEALTHY_SECONDS and self.delay > 0
        self.delay = min(self.delay * 2, self.LONGEST) if young else self.FIRST
        return self.delay
