"""`rnnserve build-kernels`: what the CPU decode path compiles is built ahead, and a server then compiles nothing.

A real `rnnserve build-kernels` process compiles a tiny model's decode steps into an inductor cache of the
test's own; a real `rnnserve serve` process on that model and cache then compiles its decode steps in the
background from the cache alone: no file is added to the cache, and no compiler process (watched every 50 ms
in the server's process tree, its compile child included) runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.start_to_compiled import compiling
from kernel_support import needs_compiler
from server_support import free_port, save_tiny_model, stop_process, wait_healthy

RNNSERVE = str(Path(sys.executable).parent / "rnnserve")
pytestmark = needs_compiler


def cache_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_") and k != "OMP_NUM_THREADS"}
    return {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}


def cache_files(cache: Path) -> set[Path]:
    return {path for path in cache.rglob("*") if path.is_file() and path.suffix in (".so", ".cpp", ".o")}


def test_a_server_after_build_kernels_compiles_nothing_itself(tmp_path):
    weights, cache = tmp_path / "weights", tmp_path / "inductor"
    weights.mkdir()
    save_tiny_model(weights, "words", "linear", "text")
    built = subprocess.run(
        [RNNSERVE, "build-kernels", "--weights", str(weights), "--max-batch", "4"],
        capture_output=True,
        text=True,
        timeout=600,
        env=cache_env(cache),
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert "words (linear) decode steps compiled" in built.stderr
    before = cache_files(cache)
    assert any(path.suffix == ".so" for path in before)

    port, log = free_port(), tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [RNNSERVE, "serve", "--weights", str(weights), "--port", str(port), "--device", "cpu", "--max-batch", "4"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cache_env(cache),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, log)
        deadline, compilers = time.monotonic() + 300, set()
        while not httpx.get(f"{url}/v1/models/words").json()["compiled_decode"]:
            assert time.monotonic() < deadline, log.read_text()
            compilers |= compiling(server.pid)
            time.sleep(0.05)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 4, "seed": 1}, timeout=60)
        assert answer.status_code == 200
    finally:
        stop_process(server)
    assert cache_files(cache) == before, "the server compiled what build-kernels had not"
    assert not compilers, f"compiler processes ran in the server: {sorted(compilers)}"
    assert "not built ahead" not in log.read_text()


def test_build_kernels_names_a_weights_folder_that_is_not_there(tmp_path):
    done = subprocess.run(
        [RNNSERVE, "build-kernels", "--weights", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 2 and "is not a directory" in done.stderr


def test_a_compiler_s_version_query_is_not_counted_as_a_compile(tmp_path):
    """Inductor asks `g++ --version` in every process that loads its graphs (to name the compiler in its cache
    keys); only a compiler that compiles counts. Both here are stand-ins named g++ that wait, as long as a look needs."""
    stand_in = tmp_path / "g++"
    stand_in.write_text("#!/bin/sh\nsleep 5\n")
    stand_in.chmod(0o755)
    query = subprocess.Popen([str(stand_in), "--version"])
    try:
        time.sleep(0.3)
        assert compiling(os.getpid()) == set()
        compile_ = subprocess.Popen([str(stand_in), "-c", "x.cpp", "-o", "x.o"])
        try:
            time.sleep(0.3)
            assert compiling(os.getpid()) == {"g++"}
        finally:
            compile_.kill()
            compile_.wait()
    finally:
        query.kill()
        query.wait()
