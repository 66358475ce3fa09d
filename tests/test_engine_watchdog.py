"""A hung engine is noticed: a real `rnnserve serve` process, real HTTP, a real SIGSTOP on its engine process.

Silent past --watchdog-seconds with work in flight, the engine's requests end with 503 `engine_restarting`
(a JSON error, or an SSE error event then [DONE]), /health says the model is not ready, the log names the model
and the process, and the engine is killed and comes back. An idle engine, silent as long, is left alone. An
engine thread (--no-engine-process) cannot be stopped apart from its server: its loop is held on its own lock.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from model import build_model
from model.io.weights import save_model
from server.engine.registry import load_models
from server_support import make_settings, running_server, serving_process, sse_payloads, tiny_config
from test_engine_restart import engine_pids, wait_until_healthy

MODEL = "sleeper"
DEADLINE = 3.0  # --watchdog-seconds
MARGIN = 60.0  # what a client waits at most past the deadline: the watchdog looks every second, then restarts
LONG = 1500  # tokens: a stream still running when its engine stops


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("watchdog")
    torch.manual_seed(0)
    save_model(build_model(tiny_config("linear", "text", 2048)), folder / f"{MODEL}.safetensors", {})
    return folder


def completion(max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": "to be", "max_tokens": max_tokens, "stream": stream, "seed": 1}


def test_a_stopped_engine_process_fails_its_requests_says_so_and_comes_back(folder):
    with serving_process(folder, "--threads", "1", "--watchdog-seconds", str(DEADLINE)) as url:
        [pid] = engine_pids(MODEL)
        answers: dict[str, httpx.Response] = {}
        with httpx.Client(timeout=DEADLINE + MARGIN) as client:  # a request left unanswered fails the test
            with client.stream("POST", f"{url}/v1/completions", json=completion(LONG, stream=True)) as streamed:
                chunks = streamed.iter_text()
                head = next(chunks)  # the stream is running
                os.kill(pid, signal.SIGSTOP)  # hung: no progress, no answer, no exit
                waiting = threading.Thread(
                    target=lambda: answers.__setitem__(
                        "json", client.post(f"{url}/v1/completions", json=completion(20))
                    )
                )
                waiting.start()
                body = head + "".join(chunks)
            waiting.join(DEADLINE + MARGIN)
            health = client.get(f"{url}/health")
        events = sse_payloads(body)
        assert events[-1]["error"]["code"] == "engine_restarting", events[-1]
        assert all("error" not in event for event in events[:-1])
        answer = answers["json"]
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_restarting", answer.text
        assert health.status_code == 503 and MODEL in health.json()["error"]["message"]
        log = (folder / "server.log").read_text()
        assert f"model {MODEL}: its engine process {pid} (worker 0) has made no progress for" in log
        assert f"model {MODEL}: its engine process {pid} died (killed by SIGKILL by the watchdog" in log

        assert wait_until_healthy(url, 120), f"the engine did not come back:\n{log}"
        assert engine_pids(MODEL) and pid not in engine_pids(MODEL)
        answer = httpx.post(f"{url}/v1/completions", json=completion(8), timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8


def test_an_idle_engine_process_silent_past_the_deadline_is_not_hung(folder):
    with serving_process(folder, "--threads", "1", "--watchdog-seconds", "1") as url:
        [pid] = engine_pids(MODEL)
        os.kill(pid, signal.SIGSTOP)  # idle: nothing waits on it, so nothing is wrong yet
        try:
            time.sleep(3)
            health = httpx.get(f"{url}/health", timeout=10)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert health.status_code == 200, health.text
        answer = httpx.post(f"{url}/v1/completions", json=completion(8), timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        assert engine_pids(MODEL) == [pid]
        assert "no progress" not in (folder / "server.log").read_text()


def test_a_blocked_engine_thread_fails_its_requests_and_serves_again_once_it_moves(folder, caplog):
    settings = make_settings(models=[folder / f"{MODEL}.safetensors"], engine_process=False, watchdog_seconds=DEADLINE)
    with running_server(settings, models=load_models(settings)) as (url, app):
        [engine] = [e for e in app.state.server.engines if e.name == MODEL]
        with httpx.Client(timeout=DEADLINE + MARGIN) as client:
            with client.stream("POST", f"{url}/v1/completions", json=completion(LONG, stream=True)) as streamed:
                chunks = streamed.iter_text()
                head = next(chunks)
                with engine._lock:  # the loop blocks at its next admission: a step that never returns
                    body = head + "".join(chunks)
                    health = client.get(f"{url}/health")
        events = sse_payloads(body)
        assert events[-1]["error"]["code"] == "engine_restarting", events[-1]
        assert health.status_code == 503 and MODEL in health.json()["error"]["message"]
        assert f"model {MODEL}: its engine thread has made no progress for" in caplog.text
        assert wait_until_healthy(url, 60)
        answer = httpx.post(f"{url}/v1/completions", json=completion(8), timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
