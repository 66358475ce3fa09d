"""The C++ decode-attention kernel (model/kernels/softmax_decode.cpp) against PyTorch's attention.

Built once per machine by the first test that needs it (about 20 s here), then found in torch's cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from model.kernels import loader as cpu_kernels
from model.kernels.cpu_features import read_cpu_features
from model.kernels.loader import load_kernels, turn_off_cpu_kernels, use_cpu_kernels
from model.attention.linear import linear_attention_chunked
from model.attention.head_shapes import split_heads
from model.attention.reformer import decode as reformer_decode
from model.attention.reformer.attention import ReformerAttention
from model.attention.softmax import SoftmaxAttention, attend_one_query

from conftest import TINY_MAX_LEN, assert_bfloat16_close, make_tiny_model, make_tokens
from kernel_support import loaded_kernels  # noqa: F401  (the `kernels` fixture)
from kernel_support import needs_compiler

KERNEL_TOLERANCE = 1e-5
# The kernels are C++ built on this machine: without a compiler there is nothing to test.
pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernel(kernels):
    return torch.ops.rnnserve.softmax_decode_attention


def pytorch_attention(q, k, v, last):
    """The eager path's attention over each row's positions [0, last]."""
    used = int(last.max()) + 1
    visible = (torch.arange(used) <= last[:, None])[:, None, None]  # (B, 1, 1, L)
    return attend_one_query(q, k[:, :, :used], v[:, :, :used], visible)


# Head sizes the vector path covers (multiples of 8 and 16, up to 8 vectors) and ones it leaves to the scalar loops.
@pytest.mark.parametrize("head_dim", [8, 16, 24, 32, 48, 64, 128, 200])
def test_the_kernel_equals_pytorch_attention_for_rows_of_different_lengths(kernel, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    rows, heads, max_len = 5, 3, 40
    # Caches as decoders hold them: rows [1, 6) of a larger state; q a strided view of the fused projection.
    k_all, v_all = (torch.randn(rows + 2, heads, max_len, head_dim, generator=gen) for _ in range(2))
    k, v = k_all[1 : rows + 1], v_all[1 : rows + 1]
    q = split_heads(torch.randn(rows, 1, 3 * heads * head_dim, generator=gen)[..., : heads * head_dim], heads)
    assert not q.is_contiguous()
    last = torch.tensor([0, 5, 17, max_len - 1, 22])
    got = kernel(q, k, v, last)
    assert got.shape == (rows, heads, 1, head_dim) and got.is_contiguous()
    torch.testing.assert_close(got, pytorch_attention(q, k, v, last), atol=KERNEL_TOLERANCE, rtol=0)
    # Row 0 sees only its first position: its output is that value, whatever the query.
    torch.testing.assert_close(got[0, :, 0], v[0, :, 0], atol=KERNEL_TOLERANCE, rtol=0)


@pytest.mark.parametrize("head_dim", [16, 24, 32, 200])
def test_a_bfloat16_cache_is_read_as_its_float32_widening(kernel, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(4, 3, 1, head_dim, generator=gen)
    k, v = (torch.randn(4, 3, 40, head_dim, generator=gen).bfloat16() for _ in range(2))
    last = torch.tensor([0, 9, 39, 16])
    got = kernel(q, k, v, last)
    assert got.dtype == torch.float32
    # the same sums over the same numbers: only where they are loaded from differs
    torch.testing.assert_close(got, kernel(q, k.float(), v.float(), last), atol=1e-6, rtol=0)
    torch.testing.assert_close(got, pytorch_attention(q, k.float(), v.float(), last), atol=KERNEL_TOLERANCE, rtol=0)


# Grouped-query attention: each key head serves heads / kv_heads query heads (a Llama's 9 and 3, a Qwen2's 1 key head).
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 32), (6, 2, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_heads_each_read_their_group_s_key_head(kernel, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(heads)
    rows, max_len = 4, 50
    q = split_heads(torch.randn(rows, 1, 2 * heads * head_dim, generator=gen)[..., : heads * head_dim], heads)
    k, v = (torch.randn(rows, kv_heads, max_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    last = torch.tensor([0, 13, max_len - 1, 30])
    got = kernel(q, k, v, last)
    assert got.shape == (rows, heads, 1, head_dim)
    torch.testing.assert_close(got, pytorch_attention(q, k.float(), v.float(), last), atol=KERNEL_TOLERANCE, rtol=0)
    # The same as the key heads repeated for each query head of their group (Hugging Face's repeat_kv).
    repeated = [t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v)]
    torch.testing.assert_close(got, kernel(q, *repeated, last), atol=0, rtol=0)


@pytest.mark.parametrize("direction", [1.0, -1.0])
def test_scores_that_climb_or_fall_by_hundreds_across_positions_stay_exact(kernel, direction):
    # The kernel keeps a running maximum over blocks of positions: scores climbing past what exp() can hold
    # (each later block's maximum far above the last) or falling from the first block must give softmax's answer.
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 1, 32, generator=gen)
    ramp = direction * torch.linspace(0, 600, 70)[None, None, :, None]  # (1, 1, L, 1)
    k = q * ramp / q.square().sum(-1, keepdim=True) * 32**0.5 + 0.01 * torch.randn(3, 2, 70, 32, generator=gen)
    v = torch.randn(3, 2, 70, 32, generator=gen)
    last = torch.tensor([69, 40, 16])
    got = kernel(q, k, v, last)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, pytorch_attention(q, k, v, last), atol=KERNEL_TOLERANCE, rtol=0)


def test_the_kernel_reads_only_the_positions_each_row_can_see(kernel):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 32, generator=gen) for n in (1, 30, 30))
    last = torch.tensor([9, 29])
    before = kernel(q, k, v, last)
    k[0, :, 10:], v[0, :, 10:] = float("nan"), float("nan")  # past row 0's last position
    after = kernel(q, k, v, last)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, last: (q, k, v, torch.tensor([3, 30])), "last position 30 outside the cache's 30"),
        (lambda q, k, v, last: (q, k, v, torch.tensor([-1, 3])), "last position -1"),
        (lambda q, k, v, last: (q.double(), k, v, last), "float32"),
        (lambda q, k, v, last: (q, k[:, :1], v, last), "must both be"),
        (lambda q, k, v, last: (q, k.bfloat16(), v, last), "must both be float32 or both bfloat16"),
        (lambda q, k, v, last: (q, k.half(), v.half(), last), "must both be float32 or both bfloat16"),
        (lambda q, k, v, last: (q, k, v, last[:1]), "last must be"),
        (lambda q, k, v, last: (q, *(torch.zeros(2, 3, 30, 32) for _ in range(2)), last), "KV dividing H"),
        (lambda q, k, v, last: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, last), "unit stride"),
    ],
)
def test_bad_inputs_are_refused_with_what_is_wrong(kernel, change, message):
    q, k, v = torch.zeros(2, 2, 1, 32), torch.zeros(2, 2, 30, 32), torch.zeros(2, 2, 30, 32)
    with pytest.raises(RuntimeError, match=message):
        kernel(*change(q, k, v, torch.tensor([3, 4])))


# Head size 32: the vectorized path on CPUs with 8- or 16-float vectors. A Llama's block: two query heads per key
# head, which the kernel takes too (rather than leaving grouped-query steps to PyTorch's operators).
@pytest.mark.parametrize(
    "kind, sizes", [("softmax", dict(d_model=64, n_heads=2)), ("softmax+llama", dict(d_model=128, n_heads=4))]
)
def test_softmax_decoding_through_the_kernel_equals_the_parallel_pass(kind, sizes):
    model = make_tiny_model(kind, **sizes)
    assert model.config.n_heads == 2 * model.config.n_kv_heads or kind == "softmax"
    build = use_cpu_kernels(model)
    assert build is not None and build.ok, build
    assert all(m.cpu_decode_kernel for m in model.modules() if isinstance(m, SoftmaxAttention))
    tokens = make_tokens(3, 3, TINY_MAX_LEN)
    with torch.inference_mode():
        parallel, _ = model(tokens, None)
        state = model.new_state(3)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps = [model.decode_step(tokens[:, t], state) for t in range(TINY_MAX_LEN)]
    calls = [e for e in prof.key_averages() if e.key == "rnnserve::softmax_decode_attention"]
    assert calls and calls[0].count == TINY_MAX_LEN * model.config.n_layers
    torch.testing.assert_close(torch.stack(steps, 1), parallel, atol=1e-4, rtol=0)


def test_a_bfloat16_llama_decodes_through_the_kernel_as_through_pytorch_s_operators():
    # A bfloat16 model's queries go to the kernel widened (its sums are float32, as attend_one_query's), its result
    # rounded back: the steps stay within bfloat16's tolerance of PyTorch's operators on the same model.
    model = make_tiny_model("softmax+llama", d_model=128, n_heads=4).to(torch.bfloat16)
    tokens = make_tokens(4, 3, 40)
    steps = {}
    for kernel_on in (False, True):
        build = use_cpu_kernels(model)
        assert build is not None and build.ok, build
        if not kernel_on:
            turn_off_cpu_kernels(model)
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            state = model.new_state(3)
            steps[kernel_on] = torch.stack([model.decode_step(tokens[:, t], state) for t in range(40)], 1)
        calls = [e.count for e in prof.key_averages() if e.key == "rnnserve::softmax_decode_attention"]
        assert calls == ([40 * model.config.n_layers] if kernel_on else []), calls
    assert steps[True].dtype == torch.bfloat16
    assert_bfloat16_close("softmax", steps[True].float(), steps[False].float())


# Head sizes of the vector path and of the scalar loops; rounds, buckets and windows that leave queries alone in
# their bucket (the query's own key shown), show keys in several rounds at once, and have no local round.
@pytest.mark.parametrize("head_dim", [8, 12, 16, 32])
@pytest.mark.parametrize("rounds, buckets, window", [(1, 2, 32), (2, 4, 8), (3, 4, 0), (1, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reformer_kernel_equals_the_masked_step(kernel, head_dim, rounds, buckets, window, dtype):
    gen = torch.Generator().manual_seed(head_dim + rounds)
    rows, heads, max_len = 5, 3, 60
    cache = reformer_decode.new_cache(rows, heads, rounds, buckets, max_len, head_dim, torch.device("cpu"), dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.buckets.copy_(torch.randint(0, buckets, cache.buckets.shape, generator=gen))
    q = torch.randn(rows, heads, 1, head_dim, generator=gen)
    k, v = q / q.norm(dim=-1, keepdim=True), torch.randn(rows, heads, 1, head_dim, generator=gen)
    query_buckets = torch.randint(0, buckets, (rows, heads, rounds, 1), generator=gen)
    # (B, 1): rows at different positions, the first with no earlier key
    pos = torch.tensor([0, 1, 5, 33, max_len - 1])[:, None]
    other = dataclasses.replace(cache, **{name: getattr(cache, name).clone() for name in ("k", "v", "buckets")})
    step = reformer_decode.CachedChunk(q, k, v, query_buckets, pos, cache, window)
    masked = reformer_decode.decode_step(step, kernel=False)
    through_kernel = reformer_decode.decode_step(dataclasses.replace(step, cache=other), kernel=True)
    torch.testing.assert_close(through_kernel, masked, atol=KERNEL_TOLERANCE, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(cache.tensors(), other.tensors()))  # the same writes


def test_reformer_decoding_through_the_kernel_equals_the_parallel_pass():
    # Head size 32: the vectorized path on CPUs with 8- or 16-float vectors.
    model = make_tiny_model("reformer", d_model=64, n_heads=2)
    build = use_cpu_kernels(model)
    assert build is not None and build.ok, build
    assert all(m.cpu_decode_kernel for m in model.modules() if isinstance(m, ReformerAttention))
    tokens = make_tokens(3, 3, TINY_MAX_LEN)
    with torch.inference_mode():
        parallel, _ = model(tokens, None)
        state = model.new_state(3)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps = [model.decode_step(tokens[:, t], state) for t in range(TINY_MAX_LEN)]
    calls = [e for e in prof.key_averages() if e.key == "rnnserve::reformer_decode_attention"]
    assert calls and calls[0].count == TINY_MAX_LEN * model.config.n_layers
    torch.testing.assert_close(torch.stack(steps, 1), parallel, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "rows, inputs, outputs",
    [(64, 128, 384), (1, 512, 128), (9, 5, 17), (70, 40, 3), (3, 128, 48), (32, 128, 384), (13, 40, 24)],
)
def test_the_packed_linear_kernel_is_a_linear_layer(rows, inputs, outputs):
    """Any row count (blocks as even as the route's block height allows), any width (a last panel part full),
    with and without a bias."""
    assert load_kernels().ok
    gen = torch.Generator().manual_seed(rows + inputs + outputs)
    x, weight, bias = (
        torch.randn(*shape, generator=gen) for shape in ((rows, 1, inputs), (outputs, inputs), (outputs,))
    )
    packed = torch.ops.rnnserve.pack_linear_weight(weight)
    for b in (bias, None):
        got = torch.ops.rnnserve.packed_linear(x, packed, b, outputs)
        assert got.shape == (rows, 1, outputs)
        torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5 * inputs**0.5, rtol=1e-5)


def test_the_packed_linear_kernel_splits_columns_over_threads_to_the_same_result():
    assert load_kernels().ok
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(64, 128, generator=gen), torch.randn(200, 128, generator=gen)
    packed = torch.ops.rnnserve.pack_linear_weight(weight)
    alone = torch.ops.rnnserve.packed_linear(x, packed, None, 200)
    torch.set_num_threads(2)  # the autouse fixture sets one thread back for the next test
    assert torch.equal(torch.ops.rnnserve.packed_linear(x, packed, None, 200), alone)


def test_the_packed_linear_kernel_refuses_what_it_cannot_compute():
    assert load_kernels().ok
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16 CPU weight"):
        torch.ops.rnnserve.pack_linear_weight(torch.ones(4, 4, dtype=torch.float64))
    packed = torch.ops.rnnserve.pack_linear_weight(torch.ones(4, 8))
    with pytest.raises(RuntimeError, match="weights packed by pack_linear_weight"):
        torch.ops.rnnserve.packed_linear(torch.ones(2, 6), packed, None, 4)  # 6 inputs for a weight of 8
    with pytest.raises(RuntimeError, match="a float32 bias of 4 numbers"):
        torch.ops.rnnserve.packed_linear(torch.ones(2, 8), packed, torch.ones(3), 4)


def bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps lie between a and b (bfloat16 tensors): their bit patterns in the integers' order."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize(
    "rows, inputs, outputs",
    [
        *((rows, 576, 192) for rows in range(1, 17)),  # every row count a decode step runs, in SmolLM's widths
        (1, 5, 17),
        (3, 7, 33),
        (16, 1536, 576),
        (9, 1, 1),
        (2, 33, 31),
        (13, 40, 24),
        (1, 576, 1000),
    ],
)
def test_the_bfloat16_packed_linear_kernel_is_pytorch_s_bfloat16_linear_layer(rows, inputs, outputs):
    """bfloat16 in and out, float32 sums rounded once: the float32 product of the same bfloat16 numbers rounded to
    bfloat16, give or take one step where the sums' order tips a rounding, and PyTorch's bfloat16 layer within
    bfloat16's precision. Odd input counts (a pair's partner is a zero) and widths that leave a panel part full."""
    assert load_kernels().ok
    gen = torch.Generator().manual_seed(rows * 7 + inputs + outputs)
    x, weight, bias = (
        torch.randn(*shape, generator=gen).bfloat16() for shape in ((rows, 1, inputs), (outputs, inputs), (outputs,))
    )
    packed = torch.ops.rnnserve.pack_linear_weight(weight)
    for b in (bias, None):
        got = torch.ops.rnnserve.packed_linear(x, packed, b, outputs)
        assert got.shape == (rows, 1, outputs) and got.dtype == torch.bfloat16
        exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
        assert bf16_ulps_apart(got, exact.bfloat16()).max() <= 1
        # PyTorch's layer sums in another order (on AMX tiles, past a few rows): a step or two apart, more in
        # the small sums where terms cancel
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=2**-7, atol=1e-2)
        assert (got == exact.bfloat16()).float().mean() > 0.97  # a step off is the rare tie-breaker, not the rule


def test_the_bfloat16_kernel_hands_rows_past_its_limit_to_pytorch_s_product():
    assert load_kernels().ok
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(12, 64, generator=gen).bfloat16(), torch.randn(40, 64, generator=gen).bfloat16()
    packed = torch.ops.rnnserve.pack_linear_weight(weight)
    assert torch.equal(torch.ops.rnnserve.packed_linear_or_dense(x, packed, None, 40, weight, 8), F.linear(x, weight))
    kernel = torch.ops.rnnserve.packed_linear_or_dense(x[:8], packed, None, 40, weight, 8)  # at the limit: the kernel
    assert torch.equal(kernel, torch.ops.rnnserve.packed_linear(x[:8], packed, None, 40))


def test_the_bfloat16_kernel_splits_columns_over_threads_to_the_same_result():
    assert load_kernels().ok
    gen = torch.Generator().manual_seed(6)
    x, weight = torch.randn(5, 128, generator=gen).bfloat16(), torch.randn(200, 128, generator=gen).bfloat16()
    packed = torch.ops.rnnserve.pack_linear_weight(weight)
    alone = torch.ops.rnnserve.packed_linear(x, packed, None, 200)
    torch.set_num_threads(2)  # the autouse fixture sets one thread back for the next test
    assert torch.equal(torch.ops.rnnserve.packed_linear(x, packed, None, 200), alone)


def test_the_bfloat16_kernel_refuses_what_it_cannot_compute():
    assert load_kernels().ok
    packed = torch.ops.rnnserve.pack_linear_weight(torch.ones(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed by pack_linear_weight from a bfloat16 weight"):
        torch.ops.rnnserve.packed_linear(torch.ones(2, 6, dtype=torch.bfloat16), packed, None, 4)
    with pytest.raises(RuntimeError, match="packed by pack_linear_weight from a bfloat16 weight"):
        float_packed = torch.ops.rnnserve.pack_linear_weight(torch.ones(4, 8))
        torch.ops.rnnserve.packed_linear(torch.ones(2, 8, dtype=torch.bfloat16), float_packed, None, 4)
    with pytest.raises(RuntimeError, match="a bfloat16 bias of 4 numbers"):
        torch.ops.rnnserve.packed_linear(torch.ones(2, 8, dtype=torch.bfloat16), packed, torch.ones(4), 4)


def test_models_without_a_kernel_are_left_alone():
    assert use_cpu_kernels(make_tiny_model("linformer")) is None


def chunked_attention(q, k, v, state):
    """The parallel form model/attention/linear.py runs without the kernel, from `state` ([S | Z]^T): the
    outputs and the state after the chunk."""
    s0, z0 = state[..., :-1, :].transpose(-1, -2), state[..., -1, :]
    y, s, z = linear_attention_chunked(q, k, v, s0, z0, LINEAR_EPS)
    return y, torch.cat([s.transpose(-1, -2), z[..., None, :]], dim=-2)  # (B, H, D + 1, F)


LINEAR_EPS = 1e-6


@pytest.mark.parametrize("length, head_dim", [(1, 32), (7, 8), (100, 32), (130, 24), (65, 64)])
def test_the_linear_prefill_kernel_equals_the_parallel_form_from_any_state(length, head_dim):
    """Outputs and the state after the chunk, from a state that already holds earlier tokens; head sizes of whole
    vectors and of a remainder, chunks shorter and longer than the parallel form's blocks of 64."""
    assert load_kernels().ok
    gen = torch.Generator().manual_seed(length + head_dim)
    q, k = (F.elu(torch.randn(3, 2, length, head_dim, generator=gen)) + 1 for _ in range(2))
    v = torch.randn(3, 2, length, head_dim, generator=gen)
    state = torch.rand(3, 2, head_dim + 1, head_dim, generator=gen) * 5  # sums of a few earlier tokens
    want_y, want_state = chunked_attention(q, k, v, state)
    got = state.clone()
    y = torch.ops.rnnserve.linear_attention_prefill(q, k, v, got, LINEAR_EPS)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want_state, atol=1e-4, rtol=1e-5)


def test_a_linear_model_prefills_through_the_kernel_to_what_it_computes_without():
    """The whole model: a prompt prefilled into rows of a batch's state (a contiguous slice, as the engine
    prefills), with the kernel on and off, then a decode step from each: the same logits and states."""
    model = make_tiny_model("linear", seed=4)
    prompt = make_tokens(3, 2, 40)

    def prefilled(kernel_on: bool):
        (use_cpu_kernels if kernel_on else turn_off_cpu_kernels)(model)
        state = model.new_state(4)
        rows = state.slice(1, 3)
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            logits, _ = model(prompt, rows)
            step = model.decode_step(prompt[:, -1], rows)
        called = any(e.name == "rnnserve::linear_attention_prefill" for e in prof.events())
        return logits, step, [layer.sz_t.clone() for layer in state.layers], called

    logits, step, states, called = prefilled(True)
    plain_logits, plain_step, plain_states, plain_called = prefilled(False)
    assert called and not plain_called
    torch.testing.assert_close(logits, plain_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step, plain_step, atol=1e-4, rtol=1e-4)
    for got, want in zip(states, plain_states):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not got[0].any() and not got[3].any()  # rows outside the slice untouched


def test_the_linear_prefill_kernel_refuses_what_it_cannot_compute():
    assert load_kernels().ok
    q = torch.ones(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="contiguous 4-D float32"):
        torch.ops.rnnserve.linear_attention_prefill(q, q, q.double(), torch.zeros(1, 2, 9, 8), LINEAR_EPS)
    with pytest.raises(RuntimeError, match="state \\(B, H, D \\+ 1, F\\)"):
        torch.ops.rnnserve.linear_attention_prefill(q, q, q, torch.zeros(1, 2, 8, 8), LINEAR_EPS)


def test_a_failed_build_is_reported_and_decoding_keeps_pytorch_attention(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "SOURCES", (tmp_path / "missing.cpp",))
    build = cpu_kernels._load_once.__wrapped__(True)  # the uncached build, as a first call in a process would run it
    assert not build.ok and "missing.cpp" in build.error
    monkeypatch.setattr(cpu_kernels, "load_kernels", lambda build_here=True: build)
    model = make_tiny_model("softmax")
    assert use_cpu_kernels(model) is build
    assert not any(m.cpu_decode_kernel for m in model.modules() if isinstance(m, SoftmaxAttention))


def test_checkouts_and_flags_build_in_folders_of_their_own(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # leave the real cache alone
    flags = ["-O3", "-fopenmp", *cpu_kernels.vector_flags()]
    here = cpu_kernels.build_directory(flags)
    assert here == cpu_kernels.build_directory(list(flags)) and here.is_dir()
    assert here.parent == tmp_path / "extensions"
    assert cpu_kernels.build_directory(flags + ["-g"]) != here
    copies = tuple(tmp_path / source.name for source in cpu_kernels.SOURCES)  # the same sources in another checkout
    for source, copy in zip(cpu_kernels.SOURCES, copies):
        copy.write_text(source.read_text())
    monkeypatch.setattr(cpu_kernels, "SOURCES", copies)
    assert cpu_kernels.build_directory(flags) != here


def test_a_build_lock_left_by_a_build_that_died_is_removed(tmp_path):
    baton = tmp_path / "lock"  # what torch's build leaves when its process is killed mid-build
    baton.touch()
    with cpu_kernels.exclusive_build(tmp_path):
        assert not baton.exists()


def test_builds_take_turns(tmp_path):
    order: list[str] = []
    inside = threading.Event()

    def second():
        inside.wait()
        with cpu_kernels.exclusive_build(tmp_path):
            order.append("second in")

    other = threading.Thread(target=second)
    other.start()
    with cpu_kernels.exclusive_build(tmp_path):
        inside.set()
        other.join(0.5)  # it cannot get in while this build holds the folder
        order.append("first out")
    other.join(10)
    assert order == ["first out", "second in"]


def test_a_process_finds_the_kernels_despite_a_dead_build_s_lock():
    flags = ["-O3", "-fopenmp", *cpu_kernels.vector_flags()]
    load_kernels()  # built (or found) here first, so the other process only loads it
    (cpu_kernels.build_directory(flags) / "lock").touch()
    code = "from model.kernels.loader import load_kernels; b = load_kernels(); print(b.ok, b.error)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.stdout.split() == ["True", "None"], done.stderr[-2000:]
    assert "left by a build" in done.stderr


def test_a_server_loads_kernels_built_ahead_and_builds_none_itself(tmp_path):
    """What a server's engine calls (build=False): the library built ahead in this machine's cache loads; with an
    empty cache nothing is compiled, one line says how to build them, and decoding goes on without them."""
    load_kernels()  # built ahead (or found), as `rnnserve build-kernels` does
    code = "from model.kernels.loader import load_kernels; b = load_kernels(build=False); print(b.ok)"
    repo = Path(__file__).resolve().parents[1]
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=repo)
    assert found.stdout.split() == ["True"], found.stderr[-2000:]
    empty = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    missing = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=repo, env=empty
    )
    assert missing.stdout.split() == ["False"], missing.stderr[-2000:]
    assert "rnnserve build-kernels" in missing.stderr
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.o"))  # no compiler ran


# ---------------------------------------------------------------- routes (RNNSERVE_CPU_ROUTE)

ROUTE_CHECK = """
import json, torch
import torch.nn.functional as F
from model.kernels.loader import cpu_route, load_kernels, packed_linear_wins
from model.attention.linear import linear_attention_chunked
torch.manual_seed(0)
build = load_kernels(build=True)
errors = []
for m, k, n in [(1, 128, 384), (3, 128, 130), (64, 128, 512), (7, 512, 128), (64, 96, 257), (32, 128, 384), (13, 40, 24)]:
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    got = torch.ops.rnnserve.packed_linear(x, torch.ops.rnnserve.pack_linear_weight(w), b, n)
    errors.append(float((got - F.linear(x, w, b)).abs().max()))
bf16_steps = 0  # bfloat16: its panels widened in registers (or dotted, on AVX512_BF16), the sums rounded once
for m, k, n in [(1, 576, 192), (5, 7, 33), (16, 40, 24)]:
    x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    got = torch.ops.rnnserve.packed_linear(x, torch.ops.rnnserve.pack_linear_weight(w), b, n)
    want = F.linear(x.float(), w.float(), b.float()).bfloat16()
    ordered = [torch.where(t.view(torch.int16) < 0, -(t.view(torch.int16).int() & 0x7FFF), t.view(torch.int16).int())
               for t in (got, want)]
    bf16_steps = max(bf16_steps, int((ordered[0] - ordered[1]).abs().max()))
last = torch.tensor([0, 7, 29, 12, 3])
mask = torch.arange(30)[None, :] <= last[:, None]
for head_dim in (24, 64, 128):  # 3, 8 and 16 vectors of 8 (AVX2, generic); 4 and 8 of 16 (AVX-512)
    q, kv = torch.randn(5, 4, 1, head_dim), torch.randn(2, 5, 4, 30, head_dim)
    got = torch.ops.rnnserve.softmax_decode_attention(q, kv[0], kv[1], last)
    want = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask[:, None, None, :])
    errors.append(float((got - want).abs().max()))
    widened = [t.bfloat16() for t in kv]  # a bfloat16 cache: read as its float32 widening
    got = torch.ops.rnnserve.softmax_decode_attention(q, *widened, last)
    want = F.scaled_dot_product_attention(q, *(t.float() for t in widened), attn_mask=mask[:, None, None, :])
    errors.append(float((got - want).abs().max()))
for length, head_dim in ((70, 32), (9, 20)):  # the prefill kernel: loops the route's flags vectorise
    q, k = (F.elu(torch.randn(2, 2, length, head_dim)) + 1 for _ in range(2))
    v, state = torch.randn(2, 2, length, head_dim), torch.rand(2, 2, head_dim + 1, head_dim)
    s0, z0 = state[..., :-1, :].transpose(-1, -2), state[..., -1, :]
    want = linear_attention_chunked(q, k, v, s0, z0, 1e-6)[0]
    errors.append(float((torch.ops.rnnserve.linear_attention_prefill(q, k, v, state, 1e-6) - want).abs().max()))
from model.config import ModelConfig
from model.decode.compiled.linear_step import whole_linear_step
from model.kernels.packed_linear import make_twin
from model.transformer import build_model
model = build_model(ModelConfig(attention="linear", d_model=64, n_heads=4, d_ff=72, n_layers=2, max_len=64)).eval()
with torch.no_grad():  # weights at a scale where attention shows in the logits
    for p in model.parameters():
        p.normal_(std=0.3)
step = whole_linear_step(make_twin(model))  # the whole decode step in one call: heads of 16, whole vectors
with torch.inference_mode():
    eager, one_call = model.new_state(3), model.new_state(3)
    tokens = torch.tensor([1, 2, 3])
    for _ in range(5):
        want, got = model.decode_step(tokens, eager), step(tokens, one_call)
        errors.append(float((want - got).abs().max()))
        tokens = want.argmax(-1)
from model.decode.sampling import BatchSampling, SamplingParams, sample
logits = torch.randn(16, 259, generator=torch.Generator().manual_seed(5)) * 3  # the C++ draw against the eager one
params = BatchSampling.from_params([SamplingParams(temperature=(0.0, 0.7, 1.0, 1.8)[r % 4], seed=r) for r in range(16)])
differing_draws = 0
for position in range(20):
    where, drawn = torch.full((16,), position), torch.empty(16, dtype=torch.long)
    torch.ops.rnnserve.categorical_draw(logits, params.temperature, params.seed, where, drawn)
    differing_draws += int((drawn != sample(logits, params, where)).sum())
import copy
from model.attention.hybrid import HybridAttention
hybrid_kernel_on = []
for head_dim, feature_map, kv_heads in ((16, "hedgehog", 0), (24, "t2r", 2), (32, "elu", 0)):  # the hybrid step
    layer = HybridAttention(ModelConfig(attention="hybrid", d_model=4 * head_dim, n_heads=4, kv_heads=kv_heads,
                                        n_layers=1, max_len=64, hybrid_window=5, hybrid_feature_map=feature_map))
    with torch.no_grad():
        for p in (*layer.feature_map.parameters(), layer.mix):
            p.normal_(std=0.5)
    state = layer.new_state(5, torch.device("cpu"), torch.float32)
    for t in (state.k, state.v, state.s):
        t.normal_()
    state.z.uniform_(0.1, 2.0)
    start, x = torch.tensor([0, 3, 4, 5, 17]), torch.randn(5, 1, 4 * head_dim)
    outputs = []
    for on in (False, True):
        layer.cpu_decode_kernel = on
        moved = copy.deepcopy(state)
        with torch.inference_mode():
            outputs.append([layer(x, start, moved)[0], moved.s, moved.z, moved.k, moved.v])
    hybrid_kernel_on.append(layer._kernel_on)
    errors += [float((a - b).abs().max()) for a, b in zip(*outputs)]
from model.decode.compiled.hybrid_step import whole_hybrid_step
from model.kernels.loader import turn_off_cpu_kernels, use_cpu_kernels
hybrid = build_model(ModelConfig(attention="hybrid", d_model=64, n_heads=2, kv_heads=1, d_ff=72, n_layers=2, max_len=64,
                                 hybrid_window=5, hybrid_feature_map="hedgehog", hybrid_features=16)).eval()
with torch.no_grad():
    for p in hybrid.parameters():
        p.normal_(std=0.3)
use_cpu_kernels(hybrid)
hybrid_step = whole_hybrid_step(make_twin(hybrid))  # the hybrid's whole step in one call: heads of 32, maps of 16
turn_off_cpu_kernels(hybrid)  # the reference: PyTorch's step
with torch.inference_mode():
    eager, one_call = hybrid.new_state(3), hybrid.new_state(3)
    tokens = torch.tensor([1, 2, 3])
    for _ in range(8 if hybrid_step is not None else 0):  # across the window's edge
        want, got = hybrid.decode_step(tokens, eager), hybrid_step(tokens, one_call)
        errors.append(float((want - got).abs().max()))
        tokens = want.argmax(-1)
print(json.dumps({"ok": build.ok, "route": build.route, "here": cpu_route(), "packed": packed_linear_wins(),
                  "max_error": max(errors), "differing_draws": differing_draws, "bf16_steps": bf16_steps,
                  "hybrid_kernel_on": hybrid_kernel_on, "hybrid_one_call": hybrid_step is not None}))
"""


def runnable_routes() -> list:
    flags = read_cpu_features().flags
    can = {"avx512": "avx512f" in flags, "avx2": {"avx2", "fma"} <= flags, "generic": True}
    here = cpu_kernels.cpu_route()
    return [
        pytest.param(
            route,
            marks=pytest.mark.skipif(
                not can[route] or route == here,
                reason=f"this CPU cannot run the {route} route"
                if not can[route]
                else f"{route} is this CPU's own route: the tests above run it",
            ),
        )
        for route in ("avx512", "avx2", "generic")
    ]


@pytest.mark.parametrize("route", runnable_routes())
def test_a_forced_route_builds_its_own_kernels_and_computes_what_pytorch_does(route, tmp_path):
    env = {**os.environ, "RNNSERVE_CPU_ROUTE": route, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", ROUTE_CHECK],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["ok"] and seen["route"] == seen["here"] == route and seen["packed"]  # forced: the kernel is used
    assert seen["max_error"] < 1e-4, seen
    assert seen["bf16_steps"] <= 1, seen  # bfloat16 products: the float32 sums' rounding, give or take one step
    assert seen["differing_draws"] == 0, seen  # the route's exponential draws PyTorch's tokens
    assert all(seen["hybrid_kernel_on"]), seen  # the hybrid step was compared through the kernel, not eager to eager
    assert seen["hybrid_one_call"], seen  # and the hybrid's whole step through its one call


def test_an_unknown_route_is_refused_with_the_ones_there_are(monkeypatch):
    monkeypatch.setenv("RNNSERVE_CPU_ROUTE", "sve2")
    with pytest.raises(
        ValueError,
        match=r"RNNSERVE_CPU_ROUTE='sve2': expected one of auto, avx512, avx2, generic, "
        r"scalar",
    ):
        cpu_kernels.cpu_route()
    monkeypatch.setenv("RNNSERVE_CPU_ROUTE", "auto")
    assert cpu_kernels.cpu_route() in cpu_kernels.ROUTE_FLAGS and not cpu_kernels.route_forced()


@pytest.mark.parametrize(
    "capability, route, capped",
    [
        ("avx2", "avx512", "avx2"),  # an AVX-512 CPU asked to run as an AVX2 one
        ("avx2", "avx2", "avx2"),
        ("avx2", "generic", "generic"),  # never up: ARM keeps its route
        ("avx512", "avx2", "avx2"),
        ("default", "avx512", "scalar"),  # PyTorch's own code without vectors: the kernels too
        ("", "avx512", "avx512"),
        ("AVX2", "avx512", "avx512"),  # PyTorch matches the value exactly and ignores this one: so do the kernels
    ],
)
def test_pytorch_s_capability_caps_the_route_down_never_up(monkeypatch, capability, route, capped):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    assert cpu_kernels.aten_capped(route) == capped


def test_a_forced_route_wins_over_pytorch_s_capability(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("RNNSERVE_CPU_ROUTE", "avx2")
    assert cpu_kernels.cpu_route() == "avx2" and cpu_kernels.route_forced()
