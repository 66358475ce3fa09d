"""A hybrid model's ring of its last keys and values in the cache dtype (`--kv-cache-dtype`): bfloat16 keys and values
rounded as they are written, the linear sums S and Z float32 whatever the dtype; the eager step, the attention kernel
and the one-call step over it; the bytes /v1/models and the roofline count.

Tolerances: a bfloat16 ring rounds each cached number to 8 significant bits, so the logits of decoding over it are
held to the float32 steps and the parallel pass within 0.05 (as softmax's bfloat16 cache is,
tests/test_kv_cache_dtype.py); the kernel and the eager step over the same bfloat16 ring compute the same float32
sums, held to 1e-5 as the float32 kernel is, and write the same rounded numbers into the ring, bit for bit.
"""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from benchmarks.roofline import token_cost
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.io.weights import load_model
from model.kernels.loader import turn_off_cpu_kernels

from conftest import make_tiny_model, make_tokens
from kernel_support import loaded_kernels  # noqa: F401  (the `kernels` fixture)
from kernel_support import needs_compiler
from server_support import save_tiny_model, serving_process
from test_hybrid_kernel import hybrid_layer, one_step, random_state

KIND = "hybrid+hedgehog"  # the shipped models' map
STEPS = 14  # past the window of 5 twice: keys leave the ring into the sums
ROUNDED = 0.05  # logits over a bfloat16 ring against float32 ones (see the module's docstring)
KERNEL = 1e-5  # the kernel against the eager step over the same ring


def tiny_hybrid(seed: int = 0):
    return make_tiny_model(KIND, seed=seed, hybrid_window=5)


def bfloat16_ring(model):
    model.kv_cache_dtype = torch.bfloat16
    return model


def ring_bytes(model, dtype: torch.dtype) -> int:
    """One sequence's ring (keys and values of every layer) in `dtype`."""
    cfg = model.config
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.hybrid_window * cfg.d_head * dtype.itemsize


def test_the_ring_takes_the_cache_dtype_and_the_sums_stay_float32():
    model = tiny_hybrid()
    float_bytes = model.state_bytes_per_sequence()
    assert model.cache_dtype() == torch.float32  # auto: as the model's dtype
    state = bfloat16_ring(model).new_state(2)
    assert model.cache_dtype() == torch.bfloat16
    for layer in state.layers:
        assert (layer.k.dtype, layer.v.dtype, layer.s.dtype, layer.z.dtype) == (torch.bfloat16,) * 2 + (
            torch.float32,
        ) * 2
    # half the ring's bytes, none of the sums'
    saved = ring_bytes(model, torch.float32) - ring_bytes(model, torch.bfloat16)
    assert model.state_bytes_per_sequence() == float_bytes - saved


@torch.inference_mode()
def test_eager_decoding_over_a_bfloat16_ring_rounds_its_keys_and_stays_near_the_parallel_pass():
    model = tiny_hybrid(seed=4)
    tokens = make_tokens(4, 3, STEPS)
    exact = EagerDecoder(model, model.new_state(3))
    rounded = EagerDecoder(model, bfloat16_ring(copy.deepcopy(model)).new_state(3))
    want = torch.stack([exact(tokens[:, t]) for t in range(STEPS)], 1)
    got = torch.stack([rounded(tokens[:, t]) for t in range(STEPS)], 1)
    # The first layer sees the same inputs on both sides: its ring is the float32 one, rounded as written.
    first_exact, first_rounded = exact.state.layers[0], rounded.state.layers[0]
    assert torch.equal(first_rounded.k, first_exact.k.bfloat16()) and torch.equal(
        first_rounded.v, first_exact.v.bfloat16()
    )
    assert first_rounded.s.dtype == torch.float32 and not torch.equal(
        first_rounded.s, torch.zeros_like(first_rounded.s)
    )
    assert not torch.equal(got, want)  # the rounding reaches the logits
    torch.testing.assert_close(got, want, atol=ROUNDED, rtol=0)
    parallel, _ = model(tokens, None)
    torch.testing.assert_close(got, parallel, atol=ROUNDED, rtol=0)


def as_bfloat16_ring(state):
    state = copy.deepcopy(state)
    state.k, state.v = state.k.bfloat16(), state.v.bfloat16()
    return state


@needs_compiler
@pytest.mark.parametrize("feature_map", ["elu", "hedgehog"])
def test_the_kernel_over_a_bfloat16_ring_equals_the_eager_step(kernels, feature_map):
    layer = hybrid_layer(feature_map, 7, head_dim=32)
    positions = [0, 3, 6, 7, 8, 23, 200, 511]  # inside the first window, at its edge, past it
    start = torch.tensor(positions)
    state = as_bfloat16_ring(random_state(layer, len(positions), seed=2))
    want, want_state = one_step(layer, state, start, seed=2, kernel=False)
    got, got_state = one_step(layer, state, start, seed=2, kernel=True)
    torch.testing.assert_close(got, want, atol=KERNEL, rtol=KERNEL)
    assert got_state.k.dtype == torch.bfloat16
    assert torch.equal(got_state.k, want_state.k) and torch.equal(got_state.v, want_state.v)  # rounded alike
    torch.testing.assert_close(got_state.s, want_state.s, atol=KERNEL, rtol=KERNEL)
    torch.testing.assert_close(got_state.z, want_state.z, atol=KERNEL, rtol=KERNEL)


@needs_compiler
def test_the_kernel_refuses_a_ring_of_two_dtypes_and_leaves_the_state(kernels):
    layer = hybrid_layer("hedgehog", 7, head_dim=32)
    state = random_state(layer, 2, seed=3)
    state.k = state.k.bfloat16()  # the values stay float32
    before = copy.deepcopy(state)
    q, k, v = torch.randn(2, 4, 1, 32), torch.randn(2, 4, 1, 32), torch.randn(2, 4, 1, 32)
    projection = layer.projection()
    with pytest.raises(RuntimeError, match="ring_v must be a contiguous float32 or bfloat16 .*both of the ring's"):
        torch.ops.rnnserve.hybrid_decode_attention(
            q, k, v, torch.tensor([9, 10]), state.k, state.v, state.s, state.z, layer.mix.detach(),
            projection.weight.detach(), projection.bias.detach(), 2, 1e-6,
        )  # fmt: skip
    for name in ("k", "v", "s", "z"):
        assert torch.equal(getattr(state, name), getattr(before, name))


@needs_compiler
@torch.inference_mode()
def test_the_one_call_step_over_a_bfloat16_ring_gives_the_eager_step_s_logits(kernels):
    model = bfloat16_ring(make_tiny_model(KIND, seed=6, d_model=64, hybrid_window=5, hybrid_features=16))
    reference = copy.deepcopy(model)
    turn_off_cpu_kernels(reference)
    compiled = CompiledDecoder(model, model.new_state(3))
    log = compiled.compile_now(None)
    assert log.error is None and compiled.compiled, log
    assert compiled._whole_step is not None, "the hybrid twin did not take the one-call step"
    assert compiled.state.layers[0].k.dtype == torch.bfloat16
    eager = EagerDecoder(reference, reference.new_state(3))
    tokens = make_tokens(6, 3, STEPS)
    for t in range(STEPS):
        torch.testing.assert_close(compiled(tokens[:, t]), eager(tokens[:, t]), atol=1e-4, rtol=0, msg=f"step {t}")


def test_the_roofline_halves_the_ring_s_bytes_only():
    cfg = tiny_hybrid().config
    full, half = (token_cost(cfg, 100, 8, bytes_per_cached=n)["state_bytes_moved"] for n in (4, 2))
    ring_moved = cfg.n_layers * 2 * cfg.n_kv_heads * 2 * cfg.hybrid_window * cfg.d_head * 4  # read and written
    assert half == full - ring_moved / 2


def test_the_server_reports_a_bfloat16_ring_and_its_bytes(tmp_path):
    weights = save_tiny_model(tmp_path, "text-hybrid", "hybrid", "text", hybrid_window=5, hybrid_feature_map="hedgehog")
    with serving_process(tmp_path, "--kv-cache-dtype", "bfloat16") as url:
        [card] = httpx.get(f"{url}/v1/models").json()["data"]
        body = {"model": "text-hybrid", "prompt": "abcdefgh", "max_tokens": 12, "temperature": 0.0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    model, _ = load_model(weights, "cpu")
    float_bytes = model.state_bytes_per_sequence()
    assert card["kv_cache_dtype"] == "bfloat16"
    assert card["state_bytes_per_sequence"] == float_bytes - ring_bytes(model, torch.bfloat16)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
