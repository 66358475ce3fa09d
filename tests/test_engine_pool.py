"""One model on several engine processes (`--workers`, server/engine/pool.py): which models get workers, how
their gauges add up, and, with real spawned processes, that requests spread over the workers and that a worker
dying fails only what it held while the model serves on and the worker comes back. Over HTTP, a real server
with two workers answers and reports them, and the default gives a small model a worker a thread."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from model.decode.sampling import SamplingParams
from server.engine.base import EngineLimits
from server.engine.client import EngineClient
from server.engine.cpu_budget import usable_cpus
from server.engine.pool import MOST_AUTO_WORKERS, SMALL_MODEL_BYTES, EnginePool, WorkerLayout, worker_layout
from server.engine.streams import EngineFailure
from server.engine.types import GenerationRequest
from server.metrics import Metrics
from server.settings import Settings
from conftest import make_tiny_model
from server_support import metric_value, running_server, save_tiny_model

LIMITS = EngineLimits(max_batch=4, max_waiting=2)


def test_small_models_get_a_worker_a_thread_big_models_and_gpus_one_engine():
    small, big = SMALL_MODEL_BYTES, SMALL_MODEL_BYTES + 1
    assert worker_layout(small, 2, None, cpu_processes=True) == WorkerLayout(workers=2, threads=1)
    assert worker_layout(small, 1, None, cpu_processes=True) == WorkerLayout(workers=1, threads=1)
    assert worker_layout(small, 8, None, cpu_processes=True) == WorkerLayout(workers=MOST_AUTO_WORKERS, threads=2)
    assert worker_layout(big, 2, None, cpu_processes=True) == WorkerLayout(workers=1, threads=2)
    assert worker_layout(small, 2, None, cpu_processes=False) == WorkerLayout(workers=1, threads=2)
    # --workers: the share divided among them, at least a thread each
    assert worker_layout(big, 4, 2, cpu_processes=True) == WorkerLayout(workers=2, threads=2)
    assert worker_layout(small, 2, 3, cpu_processes=True) == WorkerLayout(workers=3, threads=1)
    assert worker_layout(small, 4, 1, cpu_processes=True) == WorkerLayout(workers=1, threads=4)


def test_a_model_s_gauges_are_the_sum_of_its_workers():
    metrics = Metrics()
    one, two = (metrics.for_model("m", "linear", False, worker) for worker in (0, 1))

    def gauge(name: str) -> float:
        return metric_value(metrics.render()[0].decode(), name, model="m")

    one.queue(3, 1)
    two.queue(2, 4)
    assert (gauge("rnnserve_running_sequences"), gauge("rnnserve_waiting_sequences")) == (5, 5)
    one.idle(0)  # the first worker ran out of work: the second's rows still run
    assert (gauge("rnnserve_running_sequences"), gauge("rnnserve_waiting_sequences")) == (2, 4)
    one.state_allocated(100)
    two.state_allocated(50)
    assert gauge("rnnserve_decode_state_allocated_bytes") == 150
    two.engine_gone()
    assert gauge("rnnserve_decode_state_allocated_bytes") == 100 and gauge("rnnserve_running_sequences") == 0


def long_request(name: str, tokens: int = 90) -> GenerationRequest:
    return GenerationRequest(name, [1], max_new_tokens=tokens, sampling=SamplingParams(seed=1))


async def spread_then_kill_the_first(pool: EnginePool) -> list[int]:
    """Two long requests (one a worker), the first worker killed mid-stream: its stream fails, the other
    finishes, and a new request is answered meanwhile. The rows each worker held before the kill. The first
    worker is frozen (SIGSTOP) as soon as it has taken its request, so that it cannot finish before the kill."""
    streams = [await pool.enqueue(long_request("r0"))]
    os.kill(pool.clients[0].pid, signal.SIGSTOP)
    streams.append(await pool.enqueue(long_request("r1")))
    spread = [client.rows_in_flight() for client in pool.clients]
    os.kill(pool.clients[0].pid, signal.SIGKILL)
    with pytest.raises(EngineFailure, match="engine process died"):
        async for _ in streams[0]:
            pass
    rest = [event async for event in streams[1]]
    assert (rest[-1].position, rest[-1].finish_reason) == (90, "length")  # finished in full
    assert pool.ready  # the second worker serves on
    again = await pool.enqueue(long_request("again", 5), each_event=False)
    [result] = [result async for result in again]
    assert len(result.tokens) == 5
    return spread


def test_requests_spread_over_the_workers_and_a_dead_worker_leaves_the_model_serving():
    metrics, model = Metrics(), make_tiny_model("linear", seed=3)
    clients = [EngineClient("tiny", model, {}, LIMITS, metrics, 1, worker=i) for i in range(2)]
    pool = EnginePool(clients)
    pool.start()
    try:
        assert pool.ready and pool.workers == 2
        assert pool.state_bytes_allocated == 2 * clients[0].state_bytes_allocated > 0
        assert asyncio.run(spread_then_kill_the_first(pool)) == [1, 1]
        deadline = time.monotonic() + 120
        while not all(client.ready for client in clients) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(client.ready for client in clients) and pool.restarts == 1
    finally:
        pool.stop()
    assert not pool.ready


def image_body(seed: int) -> dict:
    return {"pixels": [[0.0] * 28 for _ in range(28)], "keep_rows": 20, "seed": seed}


def test_over_http_two_workers_answer_and_are_reported(tmp_path):
    save_tiny_model(tmp_path, "digits", "linear", "mnist")
    with running_server(Settings(weights=tmp_path, compile_decode=False, workers=2)) as (url, _):
        [card] = httpx.get(f"{url}/v1/models").json()["data"]
        assert card["workers"] == 2 and card["threads"] == max(1, usable_cpus().cpus // 2)
        processes = card["engine_processes"]
        assert [p["worker"] for p in processes] == [0, 1] and len({p["pid"] for p in processes}) == 2
        for process in processes:  # `ps` tells them apart: the model and the worker in the command line
            command = Path(f"/proc/{process['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            assert command == f"rnnserve engine: model digits, worker {process['worker']}", command
        answers = asyncio.run(post_all(f"{url}/v1/images/completions", [image_body(seed) for seed in range(4)]))
        assert [answer.status_code for answer in answers] == [200] * 4
        metrics = httpx.get(f"{url}/metrics").text
        allocated = metric_value(metrics, "rnnserve_decode_state_allocated_bytes", model="digits")
        assert allocated == card["state_bytes_allocated"] > 0  # both workers' (their sum: see the gauge test)


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(url, json=body) for body in bodies))


def test_by_default_a_small_model_gets_a_worker_for_each_thread_of_its_share(tmp_path, monkeypatch):
    monkeypatch.delenv("RNNSERVE_WORKERS", raising=False)  # tests/conftest.py sets one worker for the others
    monkeypatch.delenv("RNNSERVE_THREADS", raising=False)
    save_tiny_model(tmp_path, "digits", "linear", "mnist")
    with running_server(Settings(weights=tmp_path, compile_decode=False)) as (url, _):
        [card] = httpx.get(f"{url}/v1/models").json()["data"]
    cpus = usable_cpus().cpus
    assert (card["workers"], card["threads"]) == (min(cpus, MOST_AUTO_WORKERS), max(1, cpus // MOST_AUTO_WORKERS))
