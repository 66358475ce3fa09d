"""server/engine/compile_gate.py: a server's background compiles take turns, and a dead holder frees its turn."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from pathlib import Path

from model.kernels.loader import _BUILD_LOCK, wait_for_build
from server.engine.compile_gate import CompileTurns

REPO = Path(__file__).resolve().parents[1]


def test_threads_take_turns(tmp_path):
    turns, order = CompileTurns(str(tmp_path / "turns.lock")), []
    inside = threading.Event()

    def second():
        inside.wait()
        with turns:
            order.append("second in")

    other = threading.Thread(target=second)
    other.start()
    with turns:
        inside.set()
        other.join(0.5)  # it cannot get in while this turn lasts
        order.append("first out")
    other.join(10)
    assert order == ["first out", "second in"]


def test_a_process_that_dies_holding_its_turn_frees_it(tmp_path):
    turns = CompileTurns.new()
    try:
        # A child takes the turn, says so, and is killed while it holds it.
        code = (
            f"import pickle, sys, time; turns = pickle.loads({pickle.dumps(turns)!r}); turns.__enter__(); "
            "print('holding', flush=True); time.sleep(60)"
        )
        child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "holding"
        got_in = threading.Event()
        waiter = threading.Thread(target=lambda: (turns.__enter__(), got_in.set(), turns.__exit__(None, None, None)))
        waiter.start()
        assert not got_in.wait(0.5), "the child's turn is exclusive"
        child.kill()
        child.wait()
        assert got_in.wait(10), "the dead child's turn was never freed"
        waiter.join()
    finally:
        turns.remove()
    assert not Path(turns.path).exists()


def test_an_exit_waits_for_a_kernel_build_in_progress():
    with _BUILD_LOCK:  # a build running on another thread
        assert not wait_for_build(0.2)
    assert wait_for_build(0.2)
