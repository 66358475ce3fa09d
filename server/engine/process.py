"""The engine in a process of its own (`--engine-process`), so no request handling ever holds its GIL.

vLLM's V1 split: the API process parses requests and writes answers; the engine process runs the same
`Engine` (scheduler, runner, worker thread) as the in-process server. `EngineClient`
(server/engine/client.py) stands in for the `Engine` in the API process; `serve_engine` here is the
engine process's main. They talk over one pipe:

    API -> engine:  ("submit", key, request, each_event)   ("cancel", key)   ("score", key, tokens, top)   ("stop",)
    engine -> API:  ("started", StartedFacts) | ("failed", message)   ("accepted", key)   ("refused", key, error)
                    ("events", [(key, items)])   ("scored", key, result, error)   ("metric", method, args)
                    ("compiled", bool)   ("batch", [message, ...]) (deferred step records, then what follows them)

Metrics are kept by the API process, which serves /metrics: the engine sends what it would record, before
the events of the same step, so a client that has its answer finds the step counted when it scrapes.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch

from model.transformer import Transformer

from server.drain import exit_if_compiling
from server.engine.core import Engine, EngineLimits
from server.engine.scheduler import QueueFull
from server.engine.streams import ENGINE_ERROR, EngineFailure, GenerationStream, is_terminal
from server.engine.types import GenerationRequest, PromptScores, StepStats
from server.engine.validation import InvalidRequest

if TYPE_CHECKING:
    from model.compiled_decode import CompileGate

log = logging.getLogger("rnnserve.engine_process")
PROCESS_NAME_PREFIX = "rnnserve:"  # an engine process's name is this and its model's name
PR_SET_NAME = 15  # prctl(2)
DEFER_SECONDS = 0.05  # how late a step's record may reach the API process's /metrics when no event goes out


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process needs to build its engine (pickled to it at spawn)."""

    name: str
    model: Transformer
    info: dict
    limits: EngineLimits
    threads: int | None
    log_level: int
    compile_gate: CompileGate | None = None  # server/engine/compile_gate.py: the engines compile in turn


@dataclass(frozen=True)
class StartedFacts:
    state_bytes_allocated: int
    cuda_graphs: bool


# -- errors across the pipe ---------------------------------------------------
def describe_error(error: Exception | None) -> tuple[str, str] | None:
    if error is None:
        return None
    if isinstance(error, QueueFull):
        return ("queue_full", str(error))
    return (getattr(error, "code", ENGINE_ERROR), str(error))


def rebuild_error(described: tuple[str, str] | None) -> Exception | None:
    if described is None:
        return None
    kind, message = described
    return QueueFull(message) if kind == "queue_full" else EngineFailure(message, kind)


class Pipe:
    """The engine process's end of the pipe, shared by its threads.

    A step's record, or a queue gauge, can wait (`defer`): it goes with the next message sent, which keeps
    records ahead of the events they count, or on its own once the oldest has waited `DEFER_SECONDS`.
    One message every few steps instead of one per step saves the engine a pickling and a system call
    per step, and the API process a wake-up."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()
        self._deferred: list[tuple] = []
        self._deferred_since = 0.0

    def send(self, message: tuple) -> None:
        with self.lock:
            if self._deferred:
                message = ("batch", [*self._take_deferred(), message])
            self._send(message)

    def defer(self, message: tuple) -> None:
        with self.lock:
            now = time.monotonic()
            if not self._deferred:
                self._deferred_since = now
            self._deferred.append(message)
            if now - self._deferred_since >= DEFER_SECONDS:
                self._send_deferred()

    def flush(self) -> None:
        """Send what was deferred now (the engine is stopping)."""
        with self.lock:
            self._send_deferred()

    def _send_deferred(self) -> None:  # with the lock held
        if self._deferred:
            self._send(("batch", self._take_deferred()))

    def _take_deferred(self) -> list[tuple]:
        taken, self._deferred = self._deferred, []
        return taken

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # the API process is gone: nobody to tell
            pass


class PipeSink:
    """Where the engine thread puts events: tagged with the API process's key of each stream."""

    def __init__(self, pipe: Pipe):
        self.pipe = pipe
        self.lock = threading.Lock()  # held while a stream is bound, so its first events find its key
        self.keys: dict[GenerationStream, int] = {}
        self.streams: dict[int, GenerationStream] = {}

    def put_events(self, batch: list[tuple[GenerationStream, list]]) -> None:
        with self.lock:
            tagged = [(self.keys[stream], items) for stream, items in batch]
            for stream, items in batch:
                if is_terminal(items[-1]):
                    del self.streams[self.keys.pop(stream)]
        self.pipe.send(("events", tagged))


class ForwardedMetrics:
    """Stands in for `Metrics` in the engine process: every record goes to the API process."""

    def __init__(self, pipe: Pipe):
        self.pipe = pipe

    def for_model(self, model: str, attention: str, images: bool) -> "ForwardedModelMetrics":
        return ForwardedModelMetrics(self.pipe)


class ForwardedModelMetrics:
    """The `ModelMetrics` calls an engine makes, sent in order with its events."""

    def __init__(self, pipe: Pipe):
        self.pipe = pipe

    def record_step(self, stats: StepStats) -> None:
        self.pipe.defer(("metric", "record_step", (stats,)))

    def idle(self, waiting: int) -> None:
        self.pipe.send(("metric", "idle", (waiting,)))

    def queue(self, running: int, waiting: int) -> None:  # a submit's: goes with its answer ("accepted")
        self.pipe.defer(("metric", "queue", (running, waiting)))

    def state_allocated(self, nbytes: int) -> None:
        self.pipe.send(("metric", "state_allocated", (nbytes,)))


class EngineServer:
    """The engine process's receiving side: runs the API process's calls on its engine."""

    def __init__(self, engine: Engine, pipe: Pipe):
        self.engine, self.pipe = engine, pipe
        self.sink = PipeSink(pipe)

    def serve(self, conn: Connection) -> None:
        """Until told to stop, or until the API process goes away (end of file on the pipe)."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "stop":
                break
            try:
                self.handle(message)
            except Exception as exc:  # a bug in one call must not take the model down: answer it and go on
                log.exception("engine process: %r failed", message[0])
                self.answer_failure(message, EngineFailure(f"internal error: {exc}"))

    def handle(self, message: tuple) -> None:
        kind, key, *args = message
        if kind == "submit":
            self.submit(key, *args)
        elif kind == "cancel":
            self.cancel(key)
        elif kind == "score":
            self.score(key, *args)
        else:
            log.error("unknown message %r", kind)

    def answer_failure(self, message: tuple, error: EngineFailure) -> None:
        """Tell the API process that a submit or a score failed, so nothing waits on it forever."""
        kind, key = message[0], message[1]
        if kind == "submit":
            self.pipe.send(("refused", key, describe_error(error)))
        elif kind == "score":
            self.pipe.send(("scored", key, None, describe_error(error)))

    def submit(self, key: int, request: GenerationRequest, each_event: bool) -> None:
        try:
            with self.sink.lock:
                stream = self.engine.submit(request, each_event, self.sink)
                self.sink.keys[stream], self.sink.streams[key] = key, stream
        except (QueueFull, InvalidRequest) as exc:
            self.pipe.send(("refused", key, describe_error(exc)))
            return
        self.pipe.send(("accepted", key))

    def cancel(self, key: int) -> None:
        with self.sink.lock:
            stream = self.sink.streams.get(key)
        if stream is not None:
            stream.cancel()

    def score(self, key: int, tokens: list[int], top: int) -> None:
        def reply(result: PromptScores | None, error: Exception | None) -> None:
            self.pipe.send(("scored", key, result, describe_error(error)))

        try:
            self.engine.queue_score(tokens, top, reply)
        except (QueueFull, InvalidRequest) as exc:
            reply(None, exc)


def serve_engine(conn: Connection, spec: EngineSpec) -> None:
    """The engine process's main: build and run `spec`'s engine until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process stops us
    name_this_process(f"{PROCESS_NAME_PREFIX}{spec.name}")
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    pipe = Pipe(conn)
    engine = Engine(spec.name, spec.model, spec.info, spec.limits, ForwardedMetrics(pipe), spec.compile_gate, spec.threads)
    try:
        engine.start()
    except EngineFailure as exc:
        pipe.send(("failed", str(exc)))
        return
    pipe.send(("started", StartedFacts(engine.state_bytes_allocated, engine.cuda_graphs)))
    threading.Thread(target=report_compiled, args=(engine, pipe), name="compile-watch", daemon=True).start()
    try:
        EngineServer(engine, pipe).serve(conn)
    finally:
        engine.stop()  # fails what is still running or waiting: its clients hear it
        pipe.flush()
        conn.close()
    exit_if_compiling()


def name_this_process(name: str) -> None:
    """Set the name `ps`, `top` and /proc/PID/comm show (Linux keeps 15 bytes), so an operator can tell which
    model an engine process serves; elsewhere nothing happens."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def report_compiled(engine: Engine, pipe: Pipe) -> None:
    """Once the decode steps are compiled, freeze the start-up heap (as the API process does) and say so."""
    engine.wait_compiled()
    gc.collect()
    gc.freeze()
    pipe.send(("compiled", engine.compiled_decode))
