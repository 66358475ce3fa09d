"""Helpers for the server tests: tiny weights files, a real uvicorn server, SSE parsing.

Everything is real: models are saved with save_model and loaded by the
server from disk, and tests talk to uvicorn over a TCP socket.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from model import ModelConfig, build_model
from model.config import BOS_TOKEN
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams, token_logprobs
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.attention.kinds import attention_kinds
from model.io.weights import save_model
from server.app import build_app
from server.settings import Settings

KINDS = attention_kinds()
TEXT_MAX_LEN = 64
MNIST_MAX_LEN = 784


def tiny_config(attention: str, task: str, max_len: int, **overrides: Any) -> ModelConfig:
    fields = dict(
        attention=attention,
        task=task,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        max_len=max_len,
        linformer_k=8,
        reformer_rounds=1,
        reformer_buckets=4,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def save_tiny_model(
    folder: Path, name: str, attention: str, task: str, info: dict | None = None, seed: int = 0, **overrides: Any
) -> Path:
    """A random-weight model written as `folder/name.safetensors`."""
    max_len = MNIST_MAX_LEN if task == "mnist" else TEXT_MAX_LEN
    torch.manual_seed(seed)
    model = build_model(tiny_config(attention, task, max_len, **overrides))
    with torch.no_grad():  # larger weights than the training init, so samples depend on the input
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    path = folder / f"{name}.safetensors"
    save_model(model, path, info or {})
    return path


def save_script_model(folder: Path, name: str, script: bytes) -> Path:
    """A text model that writes `script[p]` at position p, whatever came before.

    The blocks are zeroed, so the final features are the layer-normed one-hot
    position embedding, and each output row points at the byte scripted for
    its position. Greedy or not, the output is the script (probability ~1).
    """
    cfg = tiny_config("linear", "text", TEXT_MAX_LEN)
    assert len(script) <= cfg.d_model, "one one-hot position per scripted byte"
    model = build_model(cfg)
    scale = 10.0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if (
                pname.startswith("blocks.")
                or pname.startswith("tok_emb")
                or pname.startswith("head")
                or pname.startswith("pos_emb")
            ):
                p.zero_()
        for pos, byte in enumerate(script):
            model.pos_emb.weight[pos, pos] = 1.0
            model.head.weight[byte, pos] += scale
    path = folder / f"{name}.safetensors"
    save_model(model, path, {})
    return path


def make_settings(**fields: Any) -> Settings:
    """Settings from `fields` and defaults only: RNNSERVE_* variables of the shell running the tests do not leak in.
    Decode steps stay eager unless asked for: compiling takes tens of seconds (tests/test_compiled_decode.py
    covers it)."""
    fields.setdefault("compile_decode", False)
    with pytest.MonkeyPatch.context() as env:
        for name in [n for n in os.environ if n.startswith("RNNSERVE_")]:
            env.delenv(name)
        return Settings(**fields)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def free_port() -> int:
    with free_socket() as sock:
        return sock.getsockname()[1]


@contextmanager
def running_server(settings: Settings, **build: Any) -> Iterator[tuple[str, Any]]:
    """uvicorn serving build_app(settings, **build) in a background thread; yields (base URL, app)."""
    import uvicorn

    app = build_app(settings, **build)
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        gc.unfreeze()  # the app froze this test process's heap at start-up, as a server does: undo it


def wait_healthy(process: subprocess.Popen, url: str, log: Path, seconds: float = 90) -> None:
    """Wait for a server process's /health to answer 200; fail with its log if it exits or takes too long."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server not healthy after {seconds:g} s:\n{log.read_text()}")


@contextmanager
def serving_process(folder: Path, *flags: str) -> Iterator[str]:
    """A real `rnnserve serve` process on the models in `folder`, healthy: yields its base URL."""
    port, log = free_port(), folder / "server.log"
    script = Path(sys.executable).parent / "rnnserve"
    with open(log, "wb") as out:
        # eager decode steps: compiling is covered by tests/test_compiled_decode.py
        proc = subprocess.Popen(
            [
                str(script),
                "serve",
                "--weights",
                str(folder),
                "--port",
                str(port),
                "--device",
                "cpu",
                "--no-compile-decode",
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url
    finally:
        stop_process(proc)


def stop_process(process: subprocess.Popen, seconds: float = 15) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited in `seconds`."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def sse_payloads(body: str) -> list[Any]:
    """Parse an SSE body, checking framing: `data: ...` events split by blank lines, ending in [DONE]."""
    assert body.endswith("\n\n"), "every event ends with a blank line"
    events = body[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, f"bad SSE event {event!r}"
    assert events[-1] == "data: [DONE]", "the stream ends with data: [DONE]"
    assert events.count("data: [DONE]") == 1
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0.0 when none)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def token_bytes(tokens: list[str]) -> list[int]:
    """Logprobs token strings back to bytes: 'bytes:\\xNN' or a one-character string."""
    out = []
    for token in tokens:
        if token.startswith("bytes:\\x"):
            out.append(int(token[len("bytes:\\x") :], 16))
        else:
            assert len(token) == 1 and ord(token) < 0x80, f"unexpected token {token!r}"
            out.append(ord(token))
    return out


@torch.inference_mode()
def eager_generation(model, prompt: list[int], count: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Tokens of eager `generate` and their log-probabilities from eager decode steps."""
    tokens = generate(
        model, torch.tensor([prompt]), len(prompt) + count, BatchSampling.from_params([params]), compiled=False
    )[0, len(prompt) :]
    decoder = EagerDecoder(model, model.new_state(1))
    logits, _ = model(torch.tensor([[BOS_TOKEN, *prompt]]), decoder.state)
    logits, logprobs = logits[:, -1], []
    for token in tokens:
        logprobs.append(float(token_logprobs(logits, token[None])[0]))
        logits = decoder(token[None])
    return tokens.tolist(), logprobs
