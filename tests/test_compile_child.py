"""The background compile's child process: it compiles what the parent then adopts from the cache, between
steps, and it dies with its parent, compilers and all (no orphan, whatever ends the parent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model.decode.compiled.decoder import CompiledDecoder
from model.decode.compiled.routing import MANY_ROWS
from model.decode.eager_and_cuda_graphs import EagerDecoder
from conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
PARENT = """
import sys, time, torch
sys.path.insert(0, "tests")
from conftest import make_tiny_model
from model.decode.compiled.decoder import CompiledDecoder
model = make_tiny_model("softmax", seed=3)
decoder = CompiledDecoder(model, model.new_state(3))
decoder.compile(background=True)
print("started", flush=True)
time.sleep(600)
"""

# A process that imports torch in its main module (as a user's script or a Ray worker may), serving two models
# of different kinds: each compiles in a child, then the process adopts the child's graphs. It prints, per model,
# inductor's cache hits and misses counted during that model's compile and adopt.
TWO_MODELS = """
import json, sys, time
import torch
sys.path.insert(0, "tests")
from torch._dynamo.utils import counters
from conftest import make_tiny_model
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.compiled.routing import MANY_ROWS

def main():
    # The last has rows enough for the graph traced for many rows (with its size hint), given threads enough;
    # a linear model after a softmax one, whose trace once left the process tracing floats otherwise.
    for kind, seed, rows in (("linear", 1, 3), ("softmax", 2, 3), ("linear", 3, MANY_ROWS.fewest)):
        model = make_tiny_model(kind, seed=seed).eval()
        decoder = CompiledDecoder(model, model.new_state(rows))
        counters.clear()
        decoder.compile(background=True)
        deadline = time.monotonic() + 600
        while not decoder.wait_compiled(0.2) and time.monotonic() < deadline:
            decoder.adopt_compiled()
        print(json.dumps({"kind": kind, "compiled": decoder.compiled, "classes": sorted(decoder.ready),
                          "threads": torch.get_num_threads(),
                          "hits": counters["inductor"]["fxgraph_cache_hit"],
                          "misses": counters["inductor"]["fxgraph_cache_miss"]}), flush=True)

if __name__ == "__main__":
    main()
"""


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def compile_child_of(pid: int, seconds: float = 120) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for child in children(pid):
            try:
                if "spawn_main" in (Path("/proc") / str(child) / "cmdline").read_text():
                    return child
            except OSError:
                pass
        time.sleep(0.1)
    pytest.fail("no compile child appeared")


def test_a_killed_parent_takes_its_compile_child_and_the_child_s_compilers_with_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        child = compile_child_of(parent.pid)
        # A spawned child leads its group once it has imported torch and unpickled its job: slow on a busy machine.
        deadline = time.monotonic() + 120
        while os.getpgid(child) != child and time.monotonic() < deadline:
            time.sleep(0.1)
        group = os.getpgid(child)
        assert group == child, "the child leads a process group of its own, its compilers in it"
        time.sleep(2.0)  # into its compile: tracing, maybe a compiler already
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(pid) for pid in group_members(group)):
            time.sleep(0.1)
        assert not [pid for pid in group_members(group) if alive(pid)], "left running after the parent died"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def group_members(group: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == group:
                members.append(int(entry.name))
        except OSError:
            pass
    return members


def test_the_adopted_graphs_decode_as_the_eager_steps():
    model = make_tiny_model("linear", seed=5)
    decoder, eager = CompiledDecoder(model, model.new_state(3)), EagerDecoder(model, model.new_state(3))
    decoder.compile(background=True)
    deadline = time.monotonic() + 600
    while not decoder.wait_compiled(0.2) and time.monotonic() < deadline:
        decoder.adopt_compiled()
    assert decoder.compiled, decoder.log
    tokens = torch.tensor([5, 6, 7])
    with torch.inference_mode():
        for _ in range(3):
            got, want = decoder(tokens), eager(tokens)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            tokens = want.argmax(-1)


def test_a_process_with_several_models_adopts_every_graph_its_compile_children_built(tmp_path):
    """No compile in the serving process: every graph the process traces at adopt is found in inductor's
    cache, for the second model as for the first, whatever the process's main module imports, and for the
    graph traced with a size hint (the hint is part of inductor's cache key)."""
    script = tmp_path / "serve_two.py"  # run as a file: its spawned children import it as their main module
    script.write_text(TWO_MODELS)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in reports] == ["linear", "softmax", "linear"], done.stdout
    many = [MANY_ROWS.fewest] if reports[-1]["threads"] > 1 else []  # none with one thread
    assert [r["classes"] for r in reports] == [[1, 2], [1, 2], [1, 2, *many]], done.stdout
    for report in reports:
        assert report["compiled"], report
        assert report["misses"] == 0 and report["hits"] >= len(report["classes"]), report


# A compile in a spawned child that then dies by SIGKILL, as a compile child does when its server stops mid-compile
# (its group is killed): whatever process-shared object the compile made is never released by the child, and the
# resource tracker the child shares with its parent warns about it when the parent exits.
KILLED_AFTER_TRACING = """
import os, signal, sys
sys.path[:0] = [".", "tests"]
import torch.multiprocessing

def compile_and_die():
    from conftest import make_tiny_model
    from model.decode.compiled.decoder import compile_fresh
    compile_fresh(make_tiny_model("linear", seed=4), 2)
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    child = torch.multiprocessing.get_context("spawn").Process(target=compile_and_die)
    child.start()
    child.join()
    print("child", child.exitcode, flush=True)
"""


def test_a_compile_killed_with_its_child_leaves_no_semaphore_behind(tmp_path):
    script = tmp_path / "killed_after_tracing.py"  # a file: the spawned child imports its main module
    script.write_text(KILLED_AFTER_TRACING)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.stdout.split() == ["child", "-9"], done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr
