"""Stopping a training run on SIGTERM or SIGINT: the loop ends after its current step and writes a checkpoint."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StopRequest:
    """Set by SIGTERM or SIGINT: the loop ends after the current step and writes a checkpoint."""

    signum: int | None = None


class TrainingStopped(Exception):
    """The run ended early on a signal, its checkpoint written."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        name = signal.Signals(signum).name
        saved = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint (--checkpoint-every 0)"
        super().__init__(
            f"stopped by {name} after step {step}; {saved}; run the same command with --resume to continue"
        )
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """While inside: SIGTERM/SIGINT only set the request; a second signal acts as usual (e.g. to quit a stuck save)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signal handlers can only be set from the main thread
        return
    signums = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in signums}

    def put_back() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def on_signal(signum: int, _frame) -> None:
        request.signum = signum
        put_back()

    for s in signums:
        signal.signal(s, on_signal)
    try:
        yield request
    finally:
        put_back()
