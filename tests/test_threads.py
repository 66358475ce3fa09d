"""Threads that run torch work use the process's intra-op thread count.

torch.set_num_threads sets OpenMP's count for the calling thread only; a thread
started later has OpenMP's default (every core) until it adopts the count. The
probe reads OpenMP's own count (`omp_get_max_threads` from the libgomp torch
loaded) inside the engine's worker thread and the compile thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time

import pytest
import torch

from model.decode.compiled.decoder import CompiledDecoder
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput
from server.engine.types import GenerationRequest
from model.decode.sampling import SamplingParams
from conftest import make_tiny_model


def openmp_threads_probe():
    """A function giving the calling thread's OpenMP thread count, or skip where it cannot be read."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: OpenMP's default count equals the process's, nothing to tell apart")
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libgomp" in line}
    if not paths:
        pytest.skip("torch was not built with GNU OpenMP here: no libgomp to ask")
    return ctypes.CDLL(sorted(paths)[0]).omp_get_max_threads


@pytest.fixture(autouse=True)
def one_process_thread():
    """The process's count is 1 (OpenMP's default in a new thread is every core), whatever ran before."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_engine_thread_decodes_with_the_process_thread_count():
    probe = openmp_threads_probe()
    engine = Engine(
        "tiny", make_tiny_model("linear", seed=1), {}, EngineLimits(max_batch=2, max_waiting=2), LocalOutput()
    )
    seen = []
    allocate = engine.runner.allocate
    engine.runner.allocate = lambda: seen.append(probe()) or allocate()  # runs first on the worker thread
    engine.start()
    try:

        async def one_answer():
            stream = engine.submit(GenerationRequest("r", [1, 2], 4, SamplingParams(seed=0)), each_event=False)
            return [r async for r in stream]

        [result] = asyncio.run(one_answer())
    finally:
        engine.stop()
    assert seen == [1]
    assert len(result.tokens) == 4


def test_the_compile_child_compiles_with_the_callers_thread_count(capfd):
    """The background compile's child sets the count of the thread that started the compile (an engine's
    share of the server's CPUs), whatever OpenMP's default in a new process."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: OpenMP's default count equals the process's, nothing to tell apart")
    rnnserve_log = logging.getLogger("rnnserve")
    level = rnnserve_log.level
    rnnserve_log.setLevel(logging.INFO)  # the child logs at the parent's level
    try:
        model = make_tiny_model("linear", seed=1)
        decoder = CompiledDecoder(model, model.new_state(2))
        decoder.compile(background=True)
        deadline = time.monotonic() + 600
        while not decoder.wait_compiled(0.2) and time.monotonic() < deadline:
            decoder.adopt_compiled()  # what the engine's thread does between steps
    finally:
        rnnserve_log.setLevel(level)
    assert decoder.compiled, decoder.log
    assert "with 1 intra-op threads" in capfd.readouterr().err
