"""Every command in README.md runs, as written, and does what the README says.

- `make serve` is started for real (on a free port) and serves the shipped weights;
  `make test` is what CI runs, so it needs no test of its own.
- Each command of the "Try it" block runs in bash against that server, with only the
  port changed, and its output is checked.
- Each command of "Train your own" runs on small generated data under the paths the
  README names, with the horizon cut to a step or two.
- "Bring your own model" runs on a small Llama (grouped-query attention, a chat template) that
  Hugging Face's `save_pretrained` wrote where the README looks for one: import, linearize (cut
  to two steps), serve, and the OpenAI client's chat script against that server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from server_support import free_port, sse_payloads, stop_process, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_PORT = "127.0.0.1:8000"
SERVER_START_SECONDS = 180
COMMAND_SECONDS = 300


def bash_blocks(section: str) -> list[str]:
    """The ```bash blocks of one `## section` of the README."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {section}' section"
    return re.findall(r"```bash\n(.*?)```", match.group(1), re.S)


def commands(block: str) -> list[str]:
    """One string per command: continuation lines joined, comments and blank lines dropped."""
    joined = block.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def run_bash(command: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["bash", "-c", "set -o pipefail; " + command], cwd=cwd, capture_output=True, timeout=COMMAND_SECONDS, env=env
    )
    assert result.returncode == 0, f"{command}\nexit {result.returncode}\n{result.stderr.decode()[-3000:]}"
    return result


# ---------------------------------------------------------------- make serve + "Try it"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`make serve` from the README, on a free port: (base URL, a working folder with examples/)."""
    assert "make serve" in commands(bash_blocks("Two commands")[0])[0]
    port = free_port()
    log = tmp_path_factory.mktemp("make_serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    env["OMP_NUM_THREADS"] = "1"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["make", "serve", f"ARGS=--port {port} --device cpu --log-level warning --no-compile-decode"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    workdir = tmp_path_factory.mktemp("readme_cwd")
    (workdir / "examples").symlink_to(ROOT / "examples")
    try:
        wait_healthy(proc, base, log, SERVER_START_SECONDS)
        yield base, workdir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def check_png_strip(result, workdir: Path) -> None:
    strip = np.asarray(Image.open(workdir / "completions.png").convert("L"))
    assert strip.shape == (28, 4 * 28)
    digit = Image.open(ROOT / "examples" / "occluded-digit.png")
    rgba = np.asarray(digit.convert("RGBA"))
    known = rgba[..., 3] > 0
    for i in range(4):  # every panel keeps the visible pixels exactly
        panel = strip[:, 28 * i : 28 * (i + 1)]
        assert np.array_equal(panel[known], rgba[..., 0][known])


def check_json_image(result, workdir: Path) -> None:
    body = json.loads(result.stdout)
    assert len(body["data"]) == 1
    assert np.asarray(body["data"][0]["pixels"]).shape == (28, 28)
    assert body["usage"]["pixels_generated"] == 784


def check_stream(result, workdir: Path) -> None:
    text = result.stdout.decode()
    assert text.rstrip().endswith("data: [DONE]")
    chunks = sse_payloads(text)
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    generated = "".join(c["choices"][0]["text"] for c in chunks)
    assert 0 < len(generated.encode()) <= 64


def check_scores(result, workdir: Path) -> None:
    choice = json.loads(result.stdout)["choices"][0]
    assert choice["text"] == "To be, or not to be"
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == len("To be, or not to be")
    assert all(lp is not None and lp <= 0 for lp in logprobs)


def check_models(result, workdir: Path) -> None:
    names = {m["id"] for m in json.loads(result.stdout)["data"]}
    kinds = ("softmax", "linear", "linformer", "reformer")
    assert names == {p.stem for p in (ROOT / "weights").glob("*.safetensors")}  # every shipped model, no other
    assert {f"{task}-{kind}" for task in ("mnist", "shakespeare") for kind in kinds} <= names


def check_rates(result, workdir: Path) -> None:
    lines = result.stdout.decode().splitlines()
    assert any(line.startswith("rnnserve_tokens_per_second{") for line in lines)
    assert any(line.startswith("rnnserve_images_per_second{") for line in lines)


TRY_IT_CHECKS = [check_png_strip, check_json_image, check_stream, check_scores, check_models, check_rates]


def test_try_it_commands_work_against_make_serve(served):
    base, workdir = served
    try_it = [c for block in bash_blocks("Try it") for c in commands(block)]
    assert len(try_it) == len(TRY_IT_CHECKS), "a README command was added or removed: update TRY_IT_CHECKS"
    for command, check in zip(try_it, TRY_IT_CHECKS):
        assert README_PORT in command
        result = run_bash(command.replace(f"http://{README_PORT}", base), workdir)
        check(result, workdir)


# ---------------------------------------------------------------- "Train your own"


def shortened(command: str) -> str:
    """The README's training horizon, cut to a step or two."""
    return re.sub(r"--(steps \d+|minutes [\d.]+)", "--steps 2 --eval-limit 4", command)


def make_train_workdir(root: Path) -> Path:
    from training.data import write_idx_images
    import torch

    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (root / "weights").mkdir()
    rng = np.random.default_rng(0)
    (root / "my-corpus.txt").write_text("".join(rng.choice(list("abc de\n"), 4000)))
    mnist = root / "path" / "to" / "mnist"
    mnist.mkdir(parents=True)
    write_idx_images(mnist / "train-images-idx3-ubyte.gz", torch.randint(0, 256, (16, 784)))
    write_idx_images(mnist / "t10k-images-idx3-ubyte.gz", torch.randint(0, 256, (4, 784)))
    from model import build_model
    from model.io.weights import save_model
    from conftest import make_tiny_config

    # What `rnnserve linearize` starts from: a tiny MNIST softmax model under the shipped model's name
    softmax = build_model(make_tiny_config("softmax", task="mnist", max_len=784))
    save_model(softmax, root / "weights" / "mnist-softmax.safetensors")
    return root


def test_train_your_own_commands_run(tmp_path):
    if not (Path(sys.executable).parent / "rnnserve").exists():
        pytest.skip("the rnnserve console script is not installed in this Python's environment (make test installs it)")
    workdir = make_train_workdir(tmp_path)
    train = [c for block in bash_blocks("Train your own") for c in commands(block)]
    assert any("--task text" in c for c in train) and any("--task mnist" in c for c in train)
    for command in train:
        long_running = " train " in command or " linearize " in command
        result = run_bash(shortened(command) if long_running else command, workdir)
        if " eval " in command:
            assert re.search(r"\d\.\d+", result.stdout.decode()), result.stdout.decode()
    from model.io.weights import read_metadata

    for name in ("my-text-linear", "my-mnist-linear", "my-mnist-hedgehog"):
        config, info = read_metadata(workdir / "weights" / f"{name}.safetensors")
        assert info["steps"] == 2 and "eval" in info
    assert (config.attention, config.linear_feature_map) == ("linear", "hedgehog")


# ---------------------------------------------------------------- "Bring your own model"


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {section}' section"
    return re.findall(r"```python\n(.*?)```", match.group(1), re.S)


def test_bring_your_own_model_commands_run(tmp_path):
    if not (Path(sys.executable).parent / "rnnserve").exists():
        pytest.skip("the rnnserve console script is not installed in this Python's environment (make test installs it)")
    pytest.importorskip("transformers", reason="writes the Llama folder (make test installs it)")
    pytest.importorskip("openai", reason="the README's client (make test installs it)")
    from hf_support import CORPUS
    from test_chat import TEMPLATE
    from test_hf_llama import llama_tokenizer, save_folder

    workdir = tmp_path / "work"
    workdir.mkdir()
    tokenizer = llama_tokenizer()
    tokenizer.chat_template = TEMPLATE
    save_folder(workdir / "smollm2", "llama", tokenizer=tokenizer)
    (workdir / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (workdir / "my-corpus.txt").write_text("\n".join(CORPUS * 3), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    imported, linearize, serve = commands(bash_blocks("Bring your own model")[0])
    run_bash(imported, workdir, env)
    run_bash(shortened(linearize), workdir, env)
    port = free_port()
    log = workdir / "serve.log"
    with open(log, "wb") as out:
        flags = f" --port {port} --device cpu --no-compile-decode --log-level warning"
        proc = subprocess.Popen(
            ["bash", "-c", serve + flags], cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log, SERVER_START_SECONDS)
        (script,) = python_blocks("Bring your own model")
        result = subprocess.run(
            [sys.executable, "-c", script.replace(f"http://{README_PORT}", base)],
            capture_output=True,
            timeout=COMMAND_SECONDS,
            text=True,
        )
    finally:
        stop_process(proc)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["smollm2", "smollm2-hedgehog"]
    # A random model may end its answer early with its end token: at most 24 tokens, and text for each
    counts = [int(line.split()[-2]) for line in lines]
    assert all(0 < count <= 24 for count in counts) and all("''" not in line for line in lines), lines
