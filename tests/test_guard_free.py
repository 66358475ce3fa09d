"""model/decode/compiled/guard_free.py: captured graphs run without guard checks only where those checks would pass.

The compiled decoder's use of it (every step of a generation passes the captured
graph's guards, runs without the guarded function, and gives eager's
log-probabilities) is tested in tests/test_compiled_decode.py; here the
mechanism itself, on a small function compiled with dynamo's eager backend
(guards, no C++ compile).
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from model.decode.compiled.guard_free import GuardFreeGraphs, dynamo_cache


def scaled_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * 3 + y).sum(-1)


class Counted:
    """The guarded function, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def graphs_for(fn) -> tuple[GuardFreeGraphs, Counted, types.FunctionType]:
    """`fn` with a code object of its own (dynamo caches per code object: each test starts with an empty cache,
    and no test resets the graphs the rest of the session shares), its guarded compile, and the two wrapped."""
    fn = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    guarded = Counted(torch.compile(fn, backend="eager", fullgraph=True, dynamic=False))
    return GuardFreeGraphs(fn, guarded), guarded, fn


def captured_graphs(x: torch.Tensor, y: torch.Tensor) -> tuple[GuardFreeGraphs, Counted]:
    """Graphs of `scaled_sum` warmed up and captured as "k" on (x, y), under inference mode."""
    graphs, guarded, _ = graphs_for(scaled_sum)
    with torch.inference_mode():
        graphs("k", x, y)
        assert graphs.capture("k", [(x, y)])
    return graphs, guarded


def pair(*shape, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype)


@torch.inference_mode()
def test_a_captured_graph_runs_without_the_guarded_call_and_gives_its_result():
    graphs, guarded, fn = graphs_for(scaled_sum)
    x, y = pair(4, 5)
    graphs("f32", x, y)  # warm-up: compiles through the guarded function
    assert guarded.calls == 1 and len(dynamo_cache(fn)) == 1
    assert graphs.capture("f32", [(x, y)]) and graphs.captured("f32")
    other = pair(4, 5)
    assert torch.equal(graphs("f32", *other), scaled_sum(*other))
    assert guarded.calls == 1, "a captured class must not go through the guard checks"


@torch.inference_mode()
def test_capture_picks_the_graph_whose_guards_accept_the_inputs_not_the_newest():
    graphs, guarded, fn = graphs_for(scaled_sum)
    graphs(None, *pair(4, 5))
    graphs(None, *pair(4, 5, dtype=torch.float64))  # the newest graph is the float64 one
    assert len(dynamo_cache(fn)) == 2
    assert graphs.capture("f32", [pair(4, 5)])
    calls = guarded.calls
    result = graphs("f32", *pair(4, 5))
    assert result.dtype == torch.float32 and guarded.calls == calls


@torch.inference_mode()
def test_guards_tell_apart_inputs_the_captured_graph_was_not_made_for():
    graphs, guarded, _ = graphs_for(scaled_sum)
    x, y = pair(4, 5)
    graphs("f32", x, y)
    graphs.capture("f32", [(x, y)])
    assert graphs.accepts("f32", x, y)
    assert not graphs.accepts("f32", x.double(), y.double())  # another dtype
    assert not graphs.accepts("f32", *pair(4, 6))  # another size (static graph)
    assert not graphs.accepts("f32", x.t().contiguous().t(), y)  # another layout
    assert not graphs.accepts("unknown", x, y)
    # Inputs no cached graph accepts: nothing is captured, and such calls stay guarded (and compile anew).
    assert not graphs.capture("f64", [(x.double(), y.double())]) and not graphs.captured("f64")
    result = graphs("f64", x.double(), y.double())
    assert result.dtype == torch.float64 and guarded.calls == 2


@torch.inference_mode()
def test_a_graph_must_accept_every_sample_of_its_class_to_be_captured():
    graphs, _, _ = graphs_for(scaled_sum)
    graphs(None, *pair(4, 5))  # static: made for 4 x 5 only
    assert not graphs.capture("rows", [pair(4, 5), pair(6, 5)])
    assert graphs.capture("rows", [pair(4, 5), pair(4, 5)])


def test_outside_inference_mode_calls_keep_their_guard_checks():
    x, y = pair(3, 2)
    graphs, guarded = captured_graphs(x, y)
    with torch.no_grad():  # the captured graph was made under inference mode: its guards would fail here
        assert not graphs.accepts("k", x, y)
        assert torch.equal(graphs("k", x, y), scaled_sum(x, y))
    assert guarded.calls == 2
    with torch.inference_mode():
        graphs(None, x, y)  # no key: guarded
    assert guarded.calls == 3


def test_a_thread_whose_state_fails_the_guards_keeps_them_and_others_do_not():
    """The guards read per-thread state too (autocast here): each thread's first call checks them."""
    x, y = pair(3, 2)
    graphs, guarded = captured_graphs(x, y)
    results = {}

    def call(name: str, autocast: bool) -> None:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            before = guarded.calls
            graphs("k", x, y)
            graphs("k", x, y)
            results[name] = guarded.calls - before

    for name, autocast in (("autocast", True), ("plain", False)):
        thread = threading.Thread(target=call, args=(name, autocast))
        thread.start()
        thread.join()
    assert results == {"autocast": 2, "plain": 0}


def test_a_capture_with_the_wrong_arguments_is_refused_by_name():
    graphs, _, _ = graphs_for(scaled_sum)
    with pytest.raises(TypeError, match=r"scaled_sum takes 2 arguments \(x, y\), got 1"):
        graphs.capture("k", [(torch.zeros(1),)])
