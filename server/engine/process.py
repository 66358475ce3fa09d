"""The engine in a process of its own (`--engine-process`), so no request handling ever holds its GIL.

vLLM's V1 split: the API process parses requests and writes answers; the engine process runs the same
`Engine` (scheduler, runner, worker thread) as the in-process server. `EngineClient`
(server/engine/client.py) stands in for the `Engine` in the API process; `serve_engine` here is the
engine process's main. They talk over one pipe, in the typed messages of server/engine/messages.py.

Metrics are kept by the API process, which serves /metrics: the engine's output here (`PipeSink`) sends each
pass's figures in the same message as the pass's events, and the API process records them on arrival. A pass
that hands out no events (a non-streamed request's steps before it ends) sends nothing: its figures wait, at most
HOLD_SECONDS, for the next message. Every message wakes the API process's reader, and the kernel tends to run a
thread woken through a pipe on the writer's core, where it takes time from the engine's next step.
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
from typing import TYPE_CHECKING, Any

import setproctitle
import torch

from model.transformer import Transformer
from model.io.vocabulary import Vocabulary

from server.engine import messages as msg
from server.engine.core import Engine, EngineLimits
from server.engine.output import Gauges
from server.engine.scheduler import QueueFull
from server.engine.shutdown import exit_if_compiling
from server.engine.streams import (
    ENGINE_ERROR,
    EngineFailure,
    Event,
    EventTarget,
    GenerationStream,
    Outbox,
    is_terminal,
    released,
)
from server.engine.types import GenerationRequest, PromptScores, StepStats
from server.engine.validation import InvalidRequest
from server.engine.watchdog import Heartbeat

if TYPE_CHECKING:
    from model.decode.compiled.background import CompileGate
    from server.metrics import ModelMetrics

log = logging.getLogger("rnnserve.engine_process")
PROCESS_NAME_PREFIX = "rnnserve:"  # an engine process's name is this and its model's name
PR_SET_NAME = 15  # prctl(2)
HOLD_SECONDS = 0.1  # how long the figures of passes without events may wait for a message to go with: /metrics lag


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process needs to build its engine (pickled to it at spawn)."""

    name: str
    model: Transformer
    info: dict[str, Any]
    limits: EngineLimits
    threads: int | None
    log_level: int
    compile_gate: CompileGate | None = None  # server/engine/compile_gate.py: the engines compile in turn
    vocabulary: Vocabulary | None = None  # a text model's tokens; None: bytes
    heartbeat: Heartbeat | None = None  # shared with the API process's watchdog (server/engine/watchdog.py)
    worker: int = 0  # which of the model's engine processes (server/engine/pool.py)


# -- errors across the pipe ---------------------------------------------------
def describe_error(error: Exception) -> msg.ErrorDescription:
    if isinstance(error, QueueFull):
        return ("queue_full", str(error))
    return (getattr(error, "code", ENGINE_ERROR), str(error))


def rebuild_error(described: tuple[str, str] | None) -> Exception | None:
    if described is None:
        return None
    kind, message = described
    return QueueFull(message) if kind == "queue_full" else EngineFailure(message, kind)


class Pipe:
    """The engine process's end of the pipe, shared by its threads."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: object) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the API process is gone: nobody to tell
                pass


class PipeSink:
    """The engine's output and its streams' event sink in an engine process: everything goes over the pipe,
    each stream's events tagged with the API process's key of it."""

    metrics: ModelMetrics | None = None  # kept by the API process

    def __init__(self, pipe: Pipe):
        self.pipe = pipe
        self.lock = threading.Lock()  # held while a stream is bound, so its first events find its key
        self.keys: dict[EventTarget, int] = {}
        self.streams: dict[int, GenerationStream] = {}
        self._held: list[StepStats] = []  # figures of passes that handed out no events, not sent yet
        self._held_since = 0.0  # time.monotonic() of the oldest of them
        self._held_lock = threading.Lock()

    def put_events(self, batch: list[tuple[EventTarget, list[Event]]]) -> None:
        """Events outside a pass (`streams.finish`), after the figures held back: figures before events."""
        events, held = self._tagged(batch), self._take_held()
        self.pipe.send(msg.Step(held, events) if held else msg.Events(events))

    def step(self, stats: StepStats, outbox: Outbox) -> None:
        """A pass's figures and events, in one message with the figures held back before them. A pass without
        events sends nothing unless the oldest figures held have waited HOLD_SECONDS."""
        events = self._tagged(released(outbox))
        held = self._hold(stats, release=bool(events))
        if held:
            self.pipe.send(msg.Step(held, events))

    def gauges(self, gauges: Gauges) -> None:
        """The queue's gauges with the figures held back, in one message (an idle engine sends them: nothing
        stays held)."""
        self.pipe.send(msg.GaugesNow(gauges, self._take_held()))

    def _hold(self, stats: StepStats, release: bool) -> list[StepStats]:
        """Holds `stats` back; returns every figure held (and holds none) when `release` or once the oldest has
        waited HOLD_SECONDS, else nothing."""
        now = time.monotonic()
        with self._held_lock:
            if not self._held:
                self._held_since = now
            self._held.append(stats)
            if not release and now - self._held_since < HOLD_SECONDS:
                return []
            held, self._held = self._held, []
        return held

    def _take_held(self) -> list[StepStats]:
        with self._held_lock:
            held, self._held = self._held, []
        return held

    def _tagged(self, batch: list[tuple[EventTarget, list[Event]]]) -> msg.TaggedEvents:
        with self.lock:
            tagged = [(self.keys[stream], items) for stream, items in batch]
            for stream, items in batch:
                if is_terminal(items[-1]):
                    del self.streams[self.keys.pop(stream)]
        return tagged


class EngineServer:
    """The engine process's receiving side: runs the API process's calls on its engine."""

    def __init__(self, engine: Engine, pipe: Pipe, sink: PipeSink):
        self.engine, self.pipe, self.sink = engine, pipe, sink

    def serve(self, conn: Connection) -> None:
        """Until told to stop, or until the API process goes away (end of file on the pipe)."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, msg.Stop):
                break
            try:
                self.handle(message)
            except Exception as exc:  # a bug in one call must not take the model down: answer it and go on
                log.exception("engine process: %r failed", type(message).__name__)
                self.answer_failure(message, EngineFailure(f"internal error: {exc}"))

    def handle(self, message: object) -> None:
        match message:
            case msg.Submit(key, request, each_event):
                self.submit(key, request, each_event)
            case msg.Cancel(key):
                self.cancel(key)
            case msg.Score(key, tokens, top):
                self.score(key, tokens, top)
            case _:
                log.error("unknown message %r", type(message).__name__)

    def answer_failure(self, message: object, error: EngineFailure) -> None:
        """Tell the API process that a submit or a score failed, so nothing waits on it forever."""
        if isinstance(message, msg.Submit):
            self.pipe.send(msg.Refused(message.key, describe_error(error)))
        elif isinstance(message, msg.Score):
            self.pipe.send(msg.Scored(message.key, None, describe_error(error)))

    def submit(self, key: int, request: GenerationRequest, each_event: bool) -> None:
        if not isinstance(request, GenerationRequest):  # the client validated its content; a wrong type is a bug
            raise TypeError(f"a submit carries a GenerationRequest, not {type(request).__name__}")
        try:
            with self.sink.lock:
                stream = self.engine.submit(request, each_event, self.sink, checked=True, report_gauges=False)
                self.sink.keys[stream], self.sink.streams[key] = key, stream
        except (QueueFull, InvalidRequest) as exc:
            self.pipe.send(msg.Refused(key, describe_error(exc)))
            return
        self.pipe.send(msg.Accepted(key, Gauges(self.engine.running, self.engine.waiting)))

    def cancel(self, key: int) -> None:
        with self.sink.lock:
            stream = self.sink.streams.get(key)
        if stream is not None:
            stream.cancel()

    def score(self, key: int, tokens: list[int], top: int) -> None:
        def reply(result: PromptScores | None, error: Exception | None) -> None:
            self.pipe.send(msg.Scored(key, result, describe_error(error) if error is not None else None))

        try:
            self.engine.queue_score(tokens, top, reply)
        except (QueueFull, InvalidRequest) as exc:
            reply(None, exc)


def serve_engine(conn: Connection, spec: EngineSpec) -> None:
    """The engine process's main: build and run `spec`'s engine until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process stops us
    name_this_process(spec.name, spec.worker)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    pipe = Pipe(conn)
    sink = PipeSink(pipe)
    engine = Engine(
        spec.name, spec.model, spec.info, spec.limits, sink, spec.compile_gate, spec.threads, spec.vocabulary
    )
    if spec.heartbeat is not None:
        engine.heartbeat = spec.heartbeat
    try:
        engine.start()
    except EngineFailure as exc:
        pipe.send(msg.StartFailed(str(exc)))
        return
    pipe.send(msg.Started(engine.state_bytes_allocated, engine.cuda_graphs, engine.cpu_route))
    threading.Thread(target=report_compiled, args=(engine, pipe), name="compile-watch", daemon=True).start()
    try:
        EngineServer(engine, pipe, sink).serve(conn)
    finally:
        engine.stop()  # fails what is still running or waiting: its clients hear it
        conn.close()
    exit_if_compiling()


def name_this_process(model: str, worker: int) -> None:
    """Name the process so an operator can tell which model and worker it serves: its title (what `ps -f`,
    `ps aux` and `top -c` show, /proc/PID/cmdline) names both; its short name (`ps`, `top`, /proc/PID/comm,
    Linux keeps 15 bytes) is the prefix and the model's name. Elsewhere than Linux, only the title."""
    setproctitle.setproctitle(f"rnnserve engine: model {model}, worker {worker}")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, f"{PROCESS_NAME_PREFIX}{model}".encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def report_compiled(engine: Engine, pipe: Pipe) -> None:
    """Once the decode steps are compiled, freeze the start-up heap (as the API process does) and say so."""
    engine.wait_compiled()
    gc.collect()
    gc.freeze()
    pipe.send(msg.Compiled(engine.compiled_decode, engine.cpu_route))
