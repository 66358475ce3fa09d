"""What a decoder's compile in the background runs under: its thread's name and lower priority, and the gate it
holds, so that a server's models compile in turn while the eager steps serving requests keep their cores."""

from __future__ import annotations

import logging
import os
import threading
from contextlib import AbstractContextManager

log = logging.getLogger("rnnserve.compiled_decode")

# A background compile's niceness above its process's: under load the eager steps get about 90% of a core
# it shares with them (Linux weighs nice 0 against nice 10 as 1024 to 110); idle, the compile runs at full speed.
BACKGROUND_COMPILE_NICENESS = 10
COMPILE_THREAD = "compile-decode"
# What a background compile holds while it runs, so that a server's models compile in turn (server/engine/compile_gate.py).
CompileGate = AbstractContextManager[object]


def background_compiles_running() -> bool:
    """Whether a decoder's background compile thread is still at work in this process."""
    return any(thread.name == COMPILE_THREAD and thread.is_alive() for thread in threading.enumerate())


def lower_thread_priority(by: int) -> None:
    """Raise the calling thread's niceness (Linux: per thread, inherited by the threads and processes it
    starts); nothing where threads have no priority of their own."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except OSError as exc:  # e.g. a sandbox that forbids it: compile at the same priority
        log.debug("could not lower the compile thread's priority: %s", exc)
