"""Contestants timed in the server's worker layout: `rnnserve bench --workers N [--peer-workers M]`.

On the CPU the server runs a small model as several one-thread engine processes (server/engine/pool.py), each
with its own rows, because a decode step's short loops scale poorly over OpenMP threads. This module times a
contestant the same way: N processes started together, each with threads/N intra-op threads and its share of the
batch's rows, every one building the contestant itself (same seed, same weights). A timed run starts when all of
them have passed a barrier and ends when the last one is done, so images/s is the batch over that span.

The peers can be given the same layout (the default: like for like) or another (`--peer-workers 1`: one process
on all the threads, as a library's users run it).
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

import torch

from .errors import BenchError

READY_TIMEOUT_S = 1800.0  # a worker compiles its graphs before it is ready: minutes on a cold cache
RUN_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class WorkerJob:
    settings: object  # DecodeSettings (not imported here: decode imports this module)
    group: str  # "rnnserve" (with its eager twins) or "peer"
    rows: int
    threads: int
    # Module-level functions of the caller's (picklable by name): (settings, group, rows) -> (contestants,
    # compile seconds), and the check of a generation's tokens (name, tokens, rows, count).
    build: Callable
    check: Callable


@dataclass(frozen=True)
class PooledRow:
    """What the parent learns of a worker's contestant: a Contestant's fields without its callables, which
    stay in the worker."""

    name: str
    kind: str
    group: str
    compiled: bool
    graphed: bool


def rows_per_worker(batch: int, workers: int) -> list[int]:
    """The batch's rows over at most `workers` processes, as even as it goes; no worker without rows."""
    used = min(workers, batch)
    return [batch // used + (i < batch % used) for i in range(used)]


def threads_per_worker(threads: int, workers: int) -> int:
    return max(1, threads // workers)


class WorkerPool:
    """`workers` processes that each build one group's contestants for their rows, then time them on request."""

    def __init__(self, settings, group: str, batch: int, workers: int, threads: int, build, check):
        self.rows = rows_per_worker(batch, workers)
        # A worker's threads do not grow when fewer are busy: the server's workers keep theirs too.
        self.threads = threads_per_worker(threads, workers)
        self._context = multiprocessing.get_context("spawn")
        self._barrier = self._context.Barrier(len(self.rows))
        self._workers: list[tuple[multiprocessing.Process, Connection]] = []
        self.compile_seconds: dict = {}
        self.contestants: list[PooledRow] = []
        try:
            # One at a time: the first compiles and builds kernels into the shared caches, the rest load them.
            for rows in self.rows:
                self._start(WorkerJob(settings, group, rows, self.threads, build, check))
        except BaseException:
            self.close()
            raise

    def _start(self, job: WorkerJob) -> None:
        mine, theirs = self._context.Pipe()
        process = self._context.Process(target=worker_main, args=(job, theirs, self._barrier), daemon=True)
        process.start()
        theirs.close()
        self._workers.append((process, mine))
        rows, compile_seconds = self._answer(mine, READY_TIMEOUT_S)
        if not self.contestants:
            self.contestants, self.compile_seconds = rows, compile_seconds

    def _answer(self, conn: Connection, timeout: float):
        if not conn.poll(timeout):
            raise BenchError(f"a bench worker process gave no answer in {timeout:.0f} s")
        try:
            status, value = conn.recv()
        except EOFError:
            raise BenchError("a bench worker process died; its error is above") from None
        if status == "error":
            raise BenchError(f"a bench worker process failed: {value}")
        return value

    def timed_run(self, name: str, tokens: int) -> tuple[float, float]:
        """(wall, CPU) seconds for every worker to generate `tokens` tokens in all its rows: from the first
        start to the last end (one monotonic clock for the whole machine), CPU summed over the workers."""
        for _, conn in self._workers:
            conn.send((name, tokens))
        spans = [self._answer(conn, RUN_TIMEOUT_S) for _, conn in self._workers]
        start, end = min(s for s, _, _ in spans), max(e for _, e, _ in spans)
        return end - start, sum(cpu for _, _, cpu in spans)

    def close(self) -> None:
        for _, conn in self._workers:
            try:
                conn.send(None)
            except OSError:
                pass
        for process, _ in self._workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._workers = []


def worker_main(job: WorkerJob, conn: Connection, barrier) -> None:
    """A worker process: build the group's contestants for `job.rows` rows, warm them up, then time runs."""
    torch.set_num_threads(job.threads)
    try:
        contestants, compile_seconds = _build(job)
        conn.send(("ready", ([_row(c) for c in contestants.values()], compile_seconds)))
    except Exception as exc:  # the parent reports it and stops the bench
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while (request := conn.recv()) is not None:
        name, tokens = request
        try:
            conn.send(("ok", _timed(contestants[name], job, tokens, barrier)))
        except Exception as exc:
            barrier.abort()
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _build(job: WorkerJob) -> tuple[dict, dict]:
    built, compile_seconds = job.build(job.settings, job.group, job.rows)
    tokens = min(8, job.settings.image_tokens)
    for contestant in built:  # warm-up: allocator, kernels
        job.check(contestant.name, contestant.generate(tokens), job.rows, tokens)
    return {c.name: c for c in built}, compile_seconds


def _row(contestant) -> PooledRow:
    return PooledRow(contestant.name, contestant.kind, contestant.group, contestant.compiled, contestant.graphed)


def _timed(contestant, job: WorkerJob, tokens: int, barrier) -> tuple[float, float, float]:
    barrier.wait(timeout=RUN_TIMEOUT_S)
    cpu, start = time.process_time(), time.perf_counter()
    out = contestant.generate(tokens)
    end, cpu = time.perf_counter(), time.process_time() - cpu
    job.check(contestant.name, out, job.rows, tokens)
    return start, end, cpu
