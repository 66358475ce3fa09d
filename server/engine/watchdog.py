"""An engine that stops making progress is noticed: a heartbeat from each engine, a watchdog in the server.

The engine's loop stamps its `Heartbeat` (a monotonic time in shared memory, so an engine process's stamps
are read by the API process) on every pass, on every step of a multi-step run, and at least once a second
while it waits for work: an idle engine is never silent for long, and needs no special case. Long work that is
progress rather than a hang (adopting a background compile's graphs, which may trace for minutes) pauses the
heartbeat: a paused engine is not watched.

The `Watchdog` (a thread of the API process) looks at every engine a few times per deadline; one that has work
in flight and whose heartbeat is older than the deadline is hung. What happens then is the engine's own
`hung()`: an engine process is killed and restarted as a dead one is (server/engine/client.py); an engine
thread cannot be killed, so it is reported not ready and its requests are ended (server/engine/core.py).
CLOCK_MONOTONIC is one clock for every process of the machine, so stamps compare across processes.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

log = logging.getLogger("rnnserve.watchdog")
PAUSED = 0.0  # the stamp of a heartbeat that is not watched (time.monotonic() is positive on Linux)
LOOKS_PER_DEADLINE = 4  # how often the watchdog looks: a hang is noticed within 1.25 deadlines
LONGEST_LOOK_SECONDS = 1.0  # and at least this often, so a hung engine's clients wait little past the deadline


class Heartbeat:
    """The time of an engine's last sign of progress, readable from another process.

    A raw shared value: no lock (a double is written and read whole), so no semaphore for the resource tracker
    to track. It pickles to a child process only while the child is spawned (multiprocessing's rule)."""

    def __init__(self) -> None:
        self._stamp = multiprocessing.RawValue(ctypes.c_double, time.monotonic())

    def beat(self) -> None:
        self._stamp.value = time.monotonic()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Long work that is progress (a compile adopted between two steps): not watched while it runs."""
        self._stamp.value = PAUSED
        try:
            yield
        finally:
            self.beat()

    def silent_seconds(self, now: float | None = None) -> float:
        """How long since the last beat; 0 while paused."""
        stamp = self._stamp.value
        return 0.0 if stamp == PAUSED else (now if now is not None else time.monotonic()) - stamp


class Watched(Protocol):
    """An engine the watchdog looks after: an engine thread (`Engine`) or an engine process's `EngineClient`."""

    name: str
    heartbeat: Heartbeat

    def has_work(self) -> bool: ...

    def hung(self, silent_seconds: float) -> None: ...


class Watchdog:
    """A thread that calls `hung()` on each engine silent past `deadline` seconds while it has work."""

    def __init__(self, engines: Sequence[Watched], deadline: float):
        self.engines, self.deadline = list(engines), deadline
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        every = min(self.deadline / LOOKS_PER_DEADLINE, LONGEST_LOOK_SECONDS)
        while not self._stopped.wait(every):
            for engine in self.engines:
                self.look_at(engine)

    def look_at(self, engine: Watched) -> None:
        silent = engine.heartbeat.silent_seconds()
        if silent <= self.deadline or not engine.has_work():
            return
        try:
            engine.hung(silent)
        except Exception:  # one engine's failure to recover must not stop the watch over the others
            log.exception("model %s: handling its hung engine failed", engine.name)
