"""The real `rnnserve serve` process on a free port, over real HTTP.

One sequence slot and one waiting place per model (--max-batch 1
--max-waiting 1), so queueing, 429 and freed slots are observable; each test runs
against engines on threads of the server's process and against engines in processes
of their own (--engine-process).
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from server_support import free_port, metric_value, save_tiny_model, wait_healthy

MODEL = "digits"  # the mnist model; 784 decode steps when nothing is known, long enough to watch
GAUGES = ("rnnserve_running_sequences", "rnnserve_waiting_sequences")


def serve_command() -> list[str]:
    """The installed console script when present, else `python -m server`."""
    script = Path(sys.executable).parent / "rnnserve"
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "server", "serve"]


def start(args: list[str], log: Path) -> subprocess.Popen:
    # Only the flags count: no RNNSERVE_* variables, and no OMP_NUM_THREADS (--threads sets the count).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_") and k != "OMP_NUM_THREADS"}
    with open(log, "wb") as out:
        return subprocess.Popen(serve_command() + args, stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The served weights, and the server's log (server.log)."""
    return tmp_path_factory.mktemp("process_weights")


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def url(folder, request):
    """The server with its engines on threads of its own process, then with each in a process of its own."""
    save_tiny_model(folder, MODEL, "linear", "mnist")
    save_tiny_model(folder, "chat", "linear", "text")
    port, log = free_port(), folder / "server.log"
    flags = ["--engine-process"] if request.param == "engine-process" else []
    proc = start(
        [
            "--weights",
            str(folder),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-batch",
            "1",
            "--max-waiting",
            "1",
            "--no-compile-decode",
            "--threads",
            "1",
            *flags,
        ],
        log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_threads_flag_sets_the_intra_op_thread_count(url, folder):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch's default count is 1 as well, so the flag's effect cannot be told apart")
    started = (folder / "server.log").read_text()
    assert "engine processes x intra-op CPU threads per model (--threads): chat 1 x 1, digits 1 x 1" in started
    assert {card["id"]: card["threads"] for card in httpx.get(f"{url}/v1/models").json()["data"]} == {
        "chat": 1,
        "digits": 1,
    }


def gauges(url: str) -> tuple[float, float, float]:
    text = httpx.get(f"{url}/metrics").text
    labels = {"model": MODEL, "attention": "linear"}
    return (
        *(metric_value(text, g, **labels) for g in GAUGES),
        metric_value(text, "rnnserve_generated_tokens_total", **labels),
    )


def wait_for(url: str, condition, what: str) -> tuple[float, float, float]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        values = gauges(url)
        if condition(*values):
            return values
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}; running, waiting, tokens = {gauges(url)}")


def blank_digit_request(**extra) -> dict:
    return {"model": MODEL, "pixels": np.zeros((28, 28), dtype=int).tolist(), "keep_rows": 0, "seed": 1, **extra}


def test_health_models_text_and_image(url):
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ids == ["chat", MODEL]
    text = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "seed": 1}, timeout=30)
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] == 4
    image = httpx.post(
        f"{url}/v1/images/completions",
        json=blank_digit_request(keep_rows=27, n=1),
        timeout=30,
        headers={"accept": "image/png"},
    )
    assert image.status_code == 200 and image.content.startswith(b"\x89PNG")


def test_429_past_the_queue_then_slots_come_back(url):
    client = httpx.Client(base_url=url, timeout=30)
    _, _, tokens_before = gauges(url)
    with client.stream("POST", "/v1/images/completions", json=blank_digit_request(stream=True)) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
        assert next(lines).startswith("data: ")  # holds the only slot
        with client.stream("POST", "/v1/images/completions", json=blank_digit_request(stream=True)) as queued:
            assert queued.status_code == 200  # submitted: takes the only waiting place
            wait_for(url, lambda r, w, t: r == 1 and w == 1, "one running and one waiting")
            refused = client.post("/v1/images/completions", json=blank_digit_request())
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert "retry later" in error["message"] and refused.headers["retry-after"] == "1"
    # both clients left mid-generation: their slots are freed, not run to the end
    _, _, tokens = wait_for(url, lambda r, w, t: r == 0 and w == 0, "gauges back to zero")
    assert tokens - tokens_before < 2 * 784
    again = client.post("/v1/images/completions", json=blank_digit_request(keep_rows=27))
    assert again.status_code == 200


def test_a_client_that_leaves_while_queued_frees_its_waiting_place(url):
    client = httpx.Client(base_url=url, timeout=30)
    with client.stream("POST", "/v1/images/completions", json=blank_digit_request(stream=True)) as running:
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")  # holds the only slot
        with client.stream("POST", "/v1/images/completions", json=blank_digit_request(stream=True)) as queued:
            assert queued.status_code == 200
            wait_for(url, lambda r, w, t: r == 1 and w == 1, "one running and one waiting")
        # the queued client left; the running one still holds the slot, so the queue must be free again
        wait_for(url, lambda r, w, t: r == 1 and w == 0, "the waiting place to be freed")
        with client.stream("POST", "/v1/images/completions", json=blank_digit_request(stream=True)) as next_in:
            assert next_in.status_code == 200  # not 429: the place was given back
            wait_for(url, lambda r, w, t: r == 1 and w == 1, "the new request to wait")


def test_batch_size_gauge_returns_to_zero_when_idle(url):
    ok = httpx.post(f"{url}/v1/images/completions", json=blank_digit_request(keep_rows=27), timeout=30)
    assert ok.status_code == 200
    deadline = time.monotonic() + 10
    while metric_value(httpx.get(f"{url}/metrics").text, "rnnserve_batch_size", model=MODEL, attention="linear") != 0:
        assert time.monotonic() < deadline, "batch size gauge stayed above zero while idle"
        time.sleep(0.1)


def test_stream_disconnect_frees_the_slot(url):
    _, _, tokens_before = gauges(url)
    with httpx.stream("POST", f"{url}/v1/images/completions", json=blank_digit_request(stream=True), timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(url, lambda r, w, t: r == 1, "the stream to hold its slot")
    _, _, tokens = wait_for(url, lambda r, w, t: r == 0 and w == 0, "running gauge back to zero")
    assert tokens - tokens_before < 784


def test_unstreamed_disconnect_frees_the_slot(url, folder):
    _, _, tokens_before = gauges(url)
    host, port = url.removeprefix("http://").split(":")
    body = httpx.Request("POST", f"{url}/v1/images/completions", json=blank_digit_request()).read()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/images/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(url, lambda r, w, t: r == 1, "the request to start")
    _, _, tokens = wait_for(url, lambda r, w, t: r == 0 and w == 0, "running gauge back to zero")
    assert tokens - tokens_before < 784
    text = httpx.get(f"{url}/metrics").text
    assert metric_value(text, "rnnserve_requests_total", endpoint="/v1/images/completions", outcome="cancelled") >= 1
    assert "never retrieved" not in (folder / "server.log").read_text()  # a cancelled answer is no error


def run_to_exit(args: list[str], tmp_path: Path) -> tuple[int, str]:
    log = tmp_path / "out.log"
    proc = start(args, log)
    return proc.wait(timeout=90), log.read_text()


def test_empty_weights_dir_fails_at_start(tmp_path):
    code, out = run_to_exit(["--weights", str(tmp_path), "--port", str(free_port())], tmp_path)
    assert code == 2
    assert "rnnserve serve: error:" in out and "has no .safetensors files" in out and "Traceback" not in out


def test_bad_weights_file_fails_at_start(tmp_path):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\x00" * 64)
    code, out = run_to_exit(["--model", str(bad), "--port", str(free_port())], tmp_path)
    assert code == 2
    assert f"{bad}: not a valid safetensors file" in out and "Traceback" not in out


@pytest.mark.parametrize("flag", ["--max-batch", "--threads"])
def test_bad_flag_value_fails_at_start(tmp_path, flag):
    code, out = run_to_exit(["--weights", str(tmp_path), flag, "0"], tmp_path)
    name = flag.removeprefix("--").replace("-", "_").upper()
    assert code == 2 and f"{flag} / RNNSERVE_{name}: Input should be greater than or equal to 1" in out


def test_requests_while_starting_get_a_503_that_says_so_then_answers(tmp_path):
    """The port is taken before the models load; until the engines run, requests get a JSON 503
    (`starting`, with Retry-After) instead of waiting unanswered in the socket's backlog."""
    save_tiny_model(tmp_path, "chat", "linear", "text")
    port, log = free_port(), tmp_path / "server.log"
    proc = start(
        ["--weights", str(tmp_path), "--port", str(port), "--device", "cpu", "--no-compile-decode", "--engine-process"],
        log,
    )
    body, answers = {"model": "chat", "prompt": "ab", "max_tokens": 2}, []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and 200 not in [a.status_code for a in answers]:
            try:
                answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=5))
            except httpx.ConnectError:  # before the port is taken
                time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    codes = [a.status_code for a in answers]
    assert codes and codes[-1] == 200 and set(codes[:-1]) == {503}, (codes, log.read_text())
    error = answers[0].json()["error"]
    assert error["code"] == "starting" and "starting" in error["message"], error
    assert answers[0].headers["retry-after"] == "2" and answers[0].headers["connection"] == "close"
    assert f"answered {len(codes) - 1} request(s) with 503 while starting" in log.read_text()


def test_a_client_trickling_its_request_cannot_hold_up_start_up():
    """The start-up responder gives each client a bounded time: stop() (the app's hand-over) returns while
    a client sending a byte every 0.2 s would go on for a minute."""
    from server.startup_responder import StartupResponder

    listener = socket.create_server(("127.0.0.1", 0))
    responder = StartupResponder(listener).start()
    client = socket.create_connection(listener.getsockname()[:2])
    sent = threading.Event()

    def trickle():
        for _ in range(300):
            try:
                client.send(b"G")
            except OSError:  # the responder gave up on us and closed
                return
            sent.set()
            time.sleep(0.2)

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    assert sent.wait(5)
    stopper = threading.Thread(target=responder.stop)
    stopper.start()
    stopper.join(20)
    try:
        assert not stopper.is_alive(), "stop() waited on a client that never finished its request"
    finally:
        client.close()
        listener.close()


def test_the_start_up_responder_answers_on_a_descriptor_past_select_s_limit():
    """A process with many files open (a test run, a busy host) gets sockets numbered past 1024, which
    select.select refuses: the responder must still answer 503 on one."""
    from server.startup_responder import StartupResponder

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"this machine allows only {hard} open files; the test needs a descriptor past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    listener = socket.create_server(("127.0.0.1", 0))
    high = socket.socket(fileno=os.dup2(listener.fileno(), 1050))
    responder = StartupResponder(high).start()
    try:
        with socket.create_connection(listener.getsockname()[:2], timeout=10) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(64).startswith(b"HTTP/1.1 503")
    finally:
        responder.stop()
        high.close()
        listener.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
