"""The hybrid decode-step kernel (model/kernels/hybrid_decode.cpp) against the eager step it replaces
(model/attention/hybrid.py `_step`): the same output and the same state after it, for rows at different positions
(inside the first window, at its edge, past it), windows that divide nothing, each feature map, grouped-query heads.

Built once per machine by the first test that needs it, then found in torch's cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny_model, make_tokens
from kernel_support import loaded_kernels  # noqa: F401  (the `kernels` fixture)
from kernel_support import needs_compiler
from model.attention.hybrid import HybridAttention, HybridState
from model.config import ModelConfig
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.kernels.loader import turn_off_cpu_kernels, use_cpu_kernels

TOLERANCE = 1e-5
pytestmark = needs_compiler


def hybrid_layer(feature_map: str, window: int, head_dim: int, kv_heads: int = 0, seed: int = 0) -> HybridAttention:
    """One layer with random weights (a random map and mix, not their identity and zero starts)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        attention="hybrid",
        task="text",
        d_model=4 * head_dim,
        n_heads=4,
        kv_heads=kv_heads,
        n_layers=1,
        d_ff=64,
        max_len=512,
        hybrid_window=window,
        hybrid_feature_map=feature_map,
    )
    layer = HybridAttention(cfg).eval()
    with torch.no_grad():
        for parameter in layer.feature_map.parameters():
            parameter.normal_(0.0, 0.3)
        layer.mix.normal_(0.0, 1.0)
    return layer


def random_state(layer: HybridAttention, batch: int, seed: int) -> HybridState:
    """A state as decoding leaves it: any ring, sums of nonnegative features (Z > 0)."""
    gen = torch.Generator().manual_seed(seed)
    state = layer.new_state(batch, torch.device("cpu"), torch.float32)
    state.k.copy_(torch.randn(state.k.shape, generator=gen))
    state.v.copy_(torch.randn(state.v.shape, generator=gen))
    state.s.copy_(torch.randn(state.s.shape, generator=gen) * 3)
    state.z.copy_(torch.rand(state.z.shape, generator=gen) * 5 + 0.1)
    return state


def one_step(layer: HybridAttention, state: HybridState, start: torch.Tensor, seed: int, kernel: bool):
    """The layer's decode step on one token per row at `start`, q, k, v views of the fused projection as in
    `forward`; returns its output (B, H, 1, D) and the state after it."""
    x = torch.randn(start.shape[0], 1, layer.qkv.in_features, generator=torch.Generator().manual_seed(seed))
    state = copy.deepcopy(state)
    layer.cpu_decode_kernel = kernel
    assert layer._kernel_on is kernel, "the kernel does not take this layer's sizes"
    with torch.inference_mode():
        q, k, v = layer._project(x, start, widen=True)
        assert q.stride(-1) == 1 and not q.is_contiguous()  # strided views, as decoding hands them over
        return layer._step(q, k, v, start, state), state


def assert_same_step(layer: HybridAttention, batch: int, positions: list[int], seed: int) -> None:
    start = torch.tensor(positions[:batch])
    state = random_state(layer, batch, seed)
    want, want_state = one_step(layer, state, start, seed, kernel=False)
    got, got_state = one_step(layer, state, start, seed, kernel=True)
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    for name in ("k", "v", "s", "z"):
        torch.testing.assert_close(getattr(got_state, name), getattr(want_state, name), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("feature_map", ["elu", "t2r", "hedgehog"])
@pytest.mark.parametrize("window", [64, 7, 1])  # the shipped window, one that divides nothing here, the last key only
def test_the_kernel_step_equals_the_eager_step(kernels, feature_map, window):
    layer = hybrid_layer(feature_map, window, head_dim=32)
    # Rows inside the first window, at its last slot, at the first key leaving it, and well past it.
    positions = [0, 3, window - 1, window, window + 1, 3 * window + 2, 200, 511]
    assert_same_step(layer, len(positions), positions, seed=window)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_kernel_step_equals_the_eager_step_for_other_head_sizes(kernels, head_dim):
    layer = hybrid_layer("hedgehog", 10, head_dim=head_dim)
    assert_same_step(layer, 5, [0, 9, 10, 33, 100], seed=head_dim)


@pytest.mark.parametrize("feature_map", ["elu", "t2r", "hedgehog"])
def test_the_kernel_step_equals_the_eager_step_with_grouped_query_heads(kernels, feature_map):
    layer = hybrid_layer(feature_map, 9, head_dim=32, kv_heads=2)  # two query heads per key head
    assert_same_step(layer, 6, [0, 4, 8, 9, 40, 300], seed=1)


def test_steps_in_a_row_keep_equal_to_the_eager_ones(kernels):
    """Twenty steps from the empty state across the window's edge: the ring and sums stay the eager ones'."""
    layer = hybrid_layer("hedgehog", 6, head_dim=32)
    eager = layer.new_state(3, torch.device("cpu"), torch.float32)
    kernel = copy.deepcopy(eager)
    start = torch.tensor([0, 2, 5])
    for step in range(20):
        want, eager = one_step(layer, eager, start + step, seed=step, kernel=False)
        got, kernel = one_step(layer, kernel, start + step, seed=step, kernel=True)
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(kernel.s, eager.s, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(kernel.z, eager.z, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_model_decodes_the_same_with_the_kernel_on(kernels):
    """Whole-model decode steps after a prefill: the layers' kernel on against off, to the logits."""
    model = make_tiny_model("hybrid+hedgehog", d_model=128, hybrid_window=5, hybrid_features=16)
    tokens = make_tokens(0, 3, 12)
    outputs = []
    for switch in (turn_off_cpu_kernels, use_cpu_kernels):
        switch(model)
        with torch.inference_mode():
            _, state = model(tokens[:, :4], model.new_state(3))
            outputs.append(torch.stack([model.decode_step(tokens[:, i], state) for i in range(4, 12)]))
    assert all(block.attn.cpu_decode_kernel for block in model.blocks), "the kernel did not turn on"
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


def test_sizes_the_build_does_not_take_keep_the_eager_step(kernels):
    if kernels.route == "scalar":
        pytest.skip("the scalar build has one lane, so it takes every head size")
    layer = hybrid_layer("hedgehog", 8, head_dim=3)  # a head size no vector route takes
    layer.cpu_decode_kernel = True
    assert not layer._kernel_on


def test_a_refused_call_says_what_is_wrong_and_leaves_the_state(kernels):
    layer = hybrid_layer("elu", 8, head_dim=32)
    state = random_state(layer, 2, seed=0)
    before = copy.deepcopy(state)
    q = torch.randn(2, 4, 1, 32)
    with pytest.raises(RuntimeError, match="z must be a contiguous float32"):
        torch.ops.rnnserve.hybrid_decode_attention(
            q, q, q, torch.tensor([3, 9]), state.k, state.v, state.s, state.z[:, :, :5], layer.mix.detach(), None,
            None, 0, 1e-6,
        )  # fmt: skip
    for name in ("k", "v", "s", "z"):
        assert torch.equal(getattr(state, name), getattr(before, name))


def test_compiled_steps_call_the_kernel_and_give_the_eager_step_s_logits(kernels):
    """The decoder's compiled graphs keep the kernel as one call that moves the state on in place: across the
    window's edge, rows finishing and joining, they give what PyTorch's step does."""
    model = make_tiny_model("hybrid+hedgehog", d_model=64, hybrid_window=5, hybrid_features=16)
    reference = copy.deepcopy(model)
    turn_off_cpu_kernels(reference)
    compiled = CompiledDecoder(model, model.new_state(4), one_call=False)
    log = compiled.compile_now(None)
    assert log.error is None and compiled.compiled, log
    assert all(block.attn.cpu_decode_kernel for block in compiled._twin.blocks), "the twin's layers run PyTorch's step"
    eager = EagerDecoder(reference, reference.new_state(4))
    tokens = make_tokens(5, 4, 16)
    schedule = [4, 4, 4, 4, 4, 4, 2, 2, 1, 4, 4, 4]  # past the window, rows finishing, one alone, rows joining
    with torch.inference_mode():
        for step, live in enumerate(schedule):
            if step and live > schedule[step - 1]:
                for decoder in (eager, compiled):
                    decoder.state.reset_rows(range(schedule[step - 1], live))
            want, got = eager(tokens[:live, step]), compiled(tokens[:live, step])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")
