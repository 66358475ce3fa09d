"""model/guard_free.py: captured graphs run without guard checks only where those checks would pass.

The compiled decoder's use of it (every step of a generation passes the captured
graph's guards, and gives eager's log-probabilities) is tested in
tests/test_compiled_decode.py; here the mechanism itself, on a small function
compiled with dynamo's eager backend (guards, no C++ compile).
"""

from __future__ import annotations

import types

import pytest
import torch

from model.guard_free import GuardFreeGraphs, dynamo_cache


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


@torch.inference_mode()
def test_a_captured_graph_runs_without_the_guarded_call_and_gives_its_result():
    graphs, guarded, fn = graphs_for(scaled_sum)
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    graphs("f32", x, y)  # warm-up: compiles through the guarded function
    assert guarded.calls == 1 and len(dynamo_cache(fn)) == 1
    assert graphs.capture("f32", x, y) and graphs.captured("f32")
    other_x, other_y = torch.randn(4, 5), torch.randn(4, 5)
    assert torch.equal(graphs("f32", other_x, other_y), scaled_sum(other_x, other_y))
    assert guarded.calls == 1, "a captured class must not go through the guard checks"


@torch.inference_mode()
def test_guards_tell_apart_inputs_the_captured_graph_was_not_made_for():
    graphs, guarded, _ = graphs_for(scaled_sum)
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    graphs("f32", x, y)
    graphs.capture("f32", x, y)
    assert graphs.accepts("f32", x, y)
    assert not graphs.accepts("f32", x.double(), y.double())  # another dtype
    assert not graphs.accepts("f32", torch.randn(4, 6), torch.randn(4, 6))  # another size (static graph)
    assert not graphs.accepts("f32", x.t().contiguous().t(), y)  # another layout
    assert not graphs.accepts("unknown", x, y)
    # Inputs no cached graph accepts: nothing is captured, and such calls stay guarded (and compile anew).
    assert not graphs.capture("f64", x.double(), y.double()) and not graphs.captured("f64")
    result = graphs("f64", x.double(), y.double())
    assert result.dtype == torch.float64 and guarded.calls == 2


def test_outside_inference_mode_calls_keep_their_guard_checks():
    graphs, guarded, _ = graphs_for(scaled_sum)
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    with torch.inference_mode():
        graphs("k", x, y)
        assert graphs.capture("k", x, y)
    with torch.no_grad():  # the captured graph was made under inference mode: its guards would fail here
        assert not graphs.accepts("k", x, y)
        assert torch.equal(graphs("k", x, y), scaled_sum(x, y))
    assert guarded.calls == 2
    with torch.inference_mode():
        graphs(None, x, y)  # no key: guarded
    assert guarded.calls == 3


def test_a_capture_with_the_wrong_arguments_is_refused_by_name():
    graphs, _, _ = graphs_for(scaled_sum)
    with pytest.raises(TypeError, match=r"scaled_sum takes 2 arguments \(x, y\), got 1"):
        graphs.capture("k", torch.zeros(1))
