"""An engine process killed under load: a real `rnnserve serve` process, real HTTP, a real SIGKILL.

What was in flight ends with 503 `engine_restarting` (a JSON error, or an SSE error event then [DONE]), the
death is logged naming the model and the signal, /health and the gauges say so at once, and the engine comes
back without a server restart.
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
from server.engine.process import PROCESS_NAME_PREFIX
from server_support import metric_value, serving_process, sse_payloads, tiny_config

MODEL = "victim"  # its engine process is named "rnnserve:victim" (Linux keeps 15 bytes of a name)
LONG = 1500  # tokens: a stream still running when its engine is killed


def engine_pids(model: str) -> list[int]:
    """Processes named as the engine process of `model` (server/engine/process.py: name_this_process)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == f"{PROCESS_NAME_PREFIX}{model}"[:15]:
                pids.append(int(entry.name))
        except OSError:  # exited meanwhile
            pass
    return pids


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("restart")
    torch.manual_seed(0)
    save_model(build_model(tiny_config("linear", "text", 2048)), folder / f"{MODEL}.safetensors", {})
    return folder


def completion(url: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": "to be", "max_tokens": max_tokens, "stream": stream, "seed": 1}


def test_a_killed_engine_fails_its_requests_with_503_says_so_and_comes_back(folder):
    with serving_process(folder, "--max-batch", "8", "--threads", "1") as url:
        [pid] = engine_pids(MODEL)
        answers: dict[str, object] = {}
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{url}/v1/completions", json=completion(url, LONG, stream=True)) as streamed:
                chunks = streamed.iter_text()
                head = next(chunks)  # the stream is running
                os.kill(pid, signal.SIGSTOP)  # frozen: what is sent now stays in flight
                waiting = [
                    threading.Thread(
                        target=lambda i=i: answers.__setitem__(
                            f"json{i}", httpx.post(f"{url}/v1/completions", json=completion(url, 20), timeout=120)
                        )
                    )
                    for i in range(3)
                ]
                for thread in waiting:
                    thread.start()
                time.sleep(1.0)
                os.kill(pid, signal.SIGKILL)
                body = head + "".join(chunks)
            for thread in waiting:
                thread.join(60)
            health = client.get(f"{url}/health")
            metrics = client.get(f"{url}/metrics").text
        events = sse_payloads(body)
        assert events[-1]["error"]["code"] == "engine_restarting", events[-1]
        assert all("error" not in event for event in events[:-1])
        for name in ("json0", "json1", "json2"):
            answer = answers[name]
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "engine_restarting"
            assert answer.headers["retry-after"] == "1"
        assert health.status_code == 503 and MODEL in health.json()["error"]["message"]
        for gauge in (
            "rnnserve_running_sequences",
            "rnnserve_waiting_sequences",
            "rnnserve_decode_state_in_use_bytes",
            "rnnserve_decode_state_allocated_bytes",
        ):
            assert metric_value(metrics, gauge, model=MODEL) == 0, gauge
        log = (folder / "server.log").read_text()
        assert f"model {MODEL}: its engine process {pid} died (killed by SIGKILL)" in log

        back = wait_until_healthy(url, 120)
        assert back, f"the engine did not come back:\n{log}"
        assert engine_pids(MODEL) and engine_pids(MODEL) != [pid]
        answer = httpx.post(f"{url}/v1/completions", json=completion(url, 8), timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "rnnserve_engine_restarts_total", model=MODEL) == 1
        assert metric_value(metrics, "rnnserve_decode_state_allocated_bytes", model=MODEL) > 0
        card = httpx.get(f"{url}/v1/models/{MODEL}").json()
        assert card["ready"] and card["state_bytes_allocated"] > 0


def wait_until_healthy(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health", timeout=5).status_code == 200:
            return True
        time.sleep(0.2)
    return False


def children_of(parent: int) -> set[int]:
    children = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                children.add(int(entry.name))
        except (OSError, ValueError, IndexError):  # exited meanwhile
            pass
    return children


def kill_the_next_child(parent: int, known: set[int], seconds: float) -> int | None:
    """SIGKILL the first child of `parent` not in `known` (a restarted engine process, while it imports torch)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        new = children_of(parent) - known
        if new:
            child = min(new)
            os.kill(child, signal.SIGKILL)
            return child
        time.sleep(0.005)
    return None


def test_a_restart_killed_while_starting_logs_the_signal_and_the_next_try_serves(folder):
    with serving_process(folder, "--max-batch", "2", "--threads", "1") as url:
        [pid] = engine_pids(MODEL)
        server = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        known = children_of(server)
        os.kill(pid, signal.SIGKILL)
        assert kill_the_next_child(server, known, 30) is not None, "no engine process was started again"
        assert wait_until_healthy(url, 120), (folder / "server.log").read_text()
        log = (folder / "server.log").read_text()
        failed = [line for line in log.splitlines() if "restarting the engine failed" in line]
        assert failed and "killed by SIGKILL" in failed[0] and "log above" not in failed[0], log
        answer = httpx.post(f"{url}/v1/completions", json=completion(url, 4), timeout=60)
        assert answer.status_code == 200


def test_not_ready_during_the_restart_back_off_says_when_to_retry(folder):
    with serving_process(folder, "--max-batch", "2", "--threads", "1") as url:
        [pid] = engine_pids(MODEL)
        server = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        known = children_of(server)
        os.kill(pid, signal.SIGKILL)
        for _ in range(4):  # each start that fails doubles the back-off: 0.5 s, then 1, 2, 4, 8 s
            child = kill_the_next_child(server, known, 60)
            assert child is not None, "no engine process was started again"
            known.add(child)
        refused = httpx.post(f"{url}/v1/completions", json=completion(url, 4), timeout=60)
        health = httpx.get(f"{url}/health", timeout=10)
        for answer in (refused, health):
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready", answer.text
            assert 1 <= int(answer.headers["retry-after"]) <= 30, answer.headers
        assert wait_until_healthy(url, 120), (folder / "server.log").read_text()
