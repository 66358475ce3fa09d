"""Turns for the background compiles of a server's models, across engine threads and engine processes.

On a small CPU, every model compiling at once starves the eager steps that serve
the first requests, and makes each model wait for all of them (benchmarks/results/NOTES.md,
"The compiled CPU decode path"). A compile holds an exclusive `flock` on one file per
server while it runs. The kernel releases it when its holder dies, so an engine
process killed mid-compile cannot keep the others waiting (a semaphore would stay
taken). flock locks belong to open files, and each turn opens the file itself, so
threads of one process take turns as processes do.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading


class CompileTurns:
    """A context manager any thread or process (it pickles as its path) enters to compile alone."""

    def __init__(self, path: str):
        self.path = path
        self._held = threading.local()  # this thread's open file while it holds its turn

    @classmethod
    def new(cls) -> "CompileTurns":
        """Turns on a fresh temporary file; `remove` it when the server stops."""
        handle, path = tempfile.mkstemp(prefix="rnnserve-compile-turns-", suffix=".lock")
        os.close(handle)
        return cls(path)

    def __enter__(self) -> "CompileTurns":
        handle = open(self.path, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        self._held.handle = handle
        return self

    def __exit__(self, *exc: object) -> None:
        handle = self._held.handle
        self._held.handle = None
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        CompileTurns.__init__(self, state["path"])
