"""Graceful drain, body timeout and the early port check, against the real `rnnserve serve` process.

One decode slot and a deep queue per model (--max-batch 1), so requests
queue behind each other and are still in flight when SIGTERM arrives: a
blank digit is 784 decode steps, and the request checked past the deadline
waits behind three others.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from server_support import free_port, metric_value, save_tiny_model, sse_payloads, wait_healthy
from test_server_process import start

MODEL = "digits"
SHUTTING_DOWN = "server is shutting down"


@dataclass
class Answer:
    status: int
    body: str


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def exit_code(self, seconds: float = 90) -> int:
        return self.process.wait(timeout=seconds)


def blank_digit(stream: bool) -> dict:
    return {"model": MODEL, "pixels": [[0] * 28] * 28, "keep_rows": 0, "seed": 1, "stream": stream}


def serve(tmp_path: Path, *flags: str) -> Server:
    weights = tmp_path / "weights"
    weights.mkdir()
    save_tiny_model(weights, MODEL, "linear", "mnist")
    port, log = free_port(), tmp_path / "server.log"
    process = start(
        [
            "--weights",
            str(weights),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-batch",
            "1",
            "--max-waiting",
            "8",
            "--no-compile-decode",
            *flags,
        ],
        log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log)
    except BaseException:
        process.kill()
        raise
    return Server(url, process, log)


@pytest.fixture
def server_factory(tmp_path):
    started: list[Server] = []

    def factory(*flags: str) -> Server:
        started.append(serve(tmp_path, *flags))
        return started[-1]

    yield factory
    for server in started:  # a test that failed before its server exited
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def send_in_background(url: str, bodies: list[dict]) -> tuple[list[threading.Thread], dict[int, Answer]]:
    """POST each body from its own thread, in order, each after the previous one was queued."""
    answers: dict[int, Answer] = {}

    def post(i: int, body: dict) -> None:
        response = httpx.post(f"{url}/v1/images/completions", json=body, timeout=120)
        answers[i] = Answer(response.status_code, response.text)

    threads = [threading.Thread(target=post, args=(i, b), daemon=True) for i, b in enumerate(bodies)]
    for i, thread in enumerate(threads):
        thread.start()
        wait_for_queue(url, i + 1)
    return threads, answers


def wait_for_queue(url: str, in_engine: int) -> None:
    """Until `in_engine` sequences of the model have reached the engine: running, waiting or already done
    (a count that only grows, so a fast first request that ends early cannot hide a later arrival)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics").text
        labels = {"model": MODEL, "attention": "linear"}
        if (
            sum(
                metric_value(text, name, **labels)
                for name in (
                    "rnnserve_running_sequences",
                    "rnnserve_waiting_sequences",
                    "rnnserve_completed_images_total",
                )
            )
            >= in_engine
        ):
            return
        time.sleep(0.02)
    pytest.fail(f"{in_engine} requests never reached the engine")


def check_refuses_new_work(url: str) -> None:
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503
    assert health.json()["error"]["code"] == "shutting_down"
    new = httpx.post(f"{url}/v1/images/completions", json=blank_digit(False), timeout=30)
    assert new.status_code == 503 and new.headers["connection"] == "close"
    error = new.json()["error"]
    assert SHUTTING_DOWN in error["message"] and error["type"] == "server_error"


def test_sigterm_refuses_new_work_and_lets_requests_in_flight_finish(server_factory):
    server = server_factory("--drain-seconds", "120")
    threads, answers = send_in_background(server.url, [blank_digit(True), blank_digit(False)])
    server.process.send_signal(signal.SIGTERM)
    check_refuses_new_work(server.url)
    scraped = httpx.get(f"{server.url}/metrics")  # Prometheus keeps scraping to the end: the last figures count
    assert scraped.status_code == 200, scraped.text
    assert metric_value(scraped.text, "rnnserve_decode_state_allocated_bytes", model=MODEL) > 0
    for thread in threads:
        thread.join(timeout=120)
    assert server.exit_code() == 0, server.log.read_text()
    streamed, whole = answers[0], answers[1]
    assert streamed.status == 200
    events = sse_payloads(streamed.body)
    assert [e["row"] for e in events if e["object"] == "image.completion.row"] == list(range(28))
    assert events[-1]["object"] == "image.completion.usage"
    assert whole.status == 200 and len(json.loads(whole.body)["data"][0]["pixels"]) == 28
    assert "draining: 2 request(s) in flight" in server.log.read_text()


def test_past_the_deadline_requests_end_with_the_shutdown_error(server_factory):
    server = server_factory("--drain-seconds", "0")
    # Three ahead of the two checked: they cannot finish before the deadline.
    ahead = [blank_digit(True)] * 3
    threads, answers = send_in_background(server.url, [*ahead, blank_digit(True), blank_digit(False)])
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=120)
    assert server.exit_code() == 0, server.log.read_text()
    streamed, whole = answers[3], answers[4]
    assert streamed.status == 200  # the status line went out when the stream was queued
    events = sse_payloads(streamed.body)  # ends with exactly one [DONE]
    assert SHUTTING_DOWN in events[-1]["error"]["message"] and events[-1]["error"]["type"] == "server_error"
    assert events[-1]["error"]["code"] == "shutting_down"  # as a request refused by the drain is told
    assert whole.status == 503
    assert SHUTTING_DOWN in json.loads(whole.body)["error"]["message"]
    assert json.loads(whole.body)["error"]["code"] == "shutting_down"
    assert "ending them" in server.log.read_text()


def test_a_body_that_does_not_arrive_gets_408_and_its_connection_closed(server_factory):
    server = server_factory("--body-timeout", "1")
    host, port = server.url.removeprefix("http://").split(":")
    slow = []
    for _ in range(20):  # each sends headers and a tenth of its body, then nothing
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt":'
        )
        slow.append(sock)
    try:
        for sock in slow:
            sock.settimeout(30)
            assert_408_and_closed(read_until_closed(sock), "body_timeout", "--body-timeout")
    finally:
        for sock in slow:
            sock.close()
    assert httpx.get(f"{server.url}/health").status_code == 200  # still serving
    text = httpx.get(f"{server.url}/metrics").text
    assert metric_value(text, "rnnserve_requests_total", endpoint="/v1/completions", outcome="timeout") == 20


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",  # stops mid-header
        b"GET /hea",  # stops mid request line
        b"",  # opens the connection and sends nothing
    ],
)
def test_headers_that_do_not_arrive_get_408_and_the_connection_closed(server_factory, sent):
    server = server_factory("--header-timeout", "1")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(sent)
        sock.settimeout(30)
        reply = read_until_closed(sock)
    assert_408_and_closed(reply, "header_timeout", "--header-timeout")
    # A kept-alive connection's next request is held to the limit too, and a prompt client is not cut.
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(30)
        first = read_one_answer(sock)
        assert first.startswith(b"HTTP/1.1 200 "), first[:200]
        sock.sendall(b"GET /heal")
        second = read_until_closed(sock)
        assert second.startswith(b"HTTP/1.1 408 "), second[:200]
    assert httpx.get(f"{server.url}/health").status_code == 200  # still serving


def assert_408_and_closed(reply: bytes, code: str, flag: str) -> None:
    """A 408 that closes the connection, with a JSON error of `code` naming the `flag` that sets the limit."""
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == code and flag in error["message"], error


def read_one_answer(sock: socket.socket) -> bytes:
    """One answer on a kept-alive connection: its head, then as many body bytes as its content-length says."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (recv returns b"")."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_port_in_use_stops_start_up_before_the_models_load(tmp_path):
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x00" * 64)  # would fail loading, so an error about it means the models came first
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "out.log"
        code = start(["--model", str(broken), "--port", str(port)], log).wait(timeout=90)
    lines = log.read_text().strip().splitlines()
    assert code == 2
    assert lines == [
        f"rnnserve serve: error: cannot listen on 127.0.0.1:{port}: "
        "the address is already in use (another server?); pass another --port"
    ]


def test_the_drain_stops_every_engine_at_once():
    """Each engine process exits on its own; stopping them one after another added their exit times up (8 models
    took 12 s to exit after SIGTERM). Here each stop waits until all have begun: one at a time never gets there."""
    from server.drain import _stop_all

    class Stoppable:
        def __init__(self, everyone: threading.Barrier):
            self.everyone, self.stopped = everyone, False

        def stop(self) -> None:
            self.everyone.wait(timeout=10)  # raises BrokenBarrierError unless every stop runs at the same time
            self.stopped = True

    everyone = threading.Barrier(4)
    engines = [Stoppable(everyone) for _ in range(4)]
    _stop_all(engines)
    assert all(engine.stopped for engine in engines)
