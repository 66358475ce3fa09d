"""Devices and dtypes: CPU and CUDA, float32 and bfloat16.

Every test body runs for "cpu" and for "cuda"; the CUDA cases skip with a
reason on a machine without a GPU, and on one with a GPU they compare
against CPU float32, the reference the other test files check exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams, row_points, sample
from model.io.weights import load_model, save_model

from conftest import TINY_MAX_LEN, assert_bfloat16_close, make_tiny_model, make_tokens, random_bytes, shared_tiny_model

NO_CUDA = not torch.cuda.is_available()
cuda_only = pytest.mark.skipif(
    NO_CUDA, reason="CUDA is not available on this machine (torch.cuda.is_available() is False)"
)
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


@torch.no_grad()
def logits_on(model, tokens: torch.Tensor, device: str, dtype: torch.dtype, chunks: list[int] | None = None):
    """Logits (float32, on CPU) of `tokens` from a copy of `model` on device/dtype,
    parallel (chunks None) or chunked with a carried state."""
    moved = copy.deepcopy(model).to(device=device, dtype=dtype)
    tokens = tokens.to(device)
    if chunks is None:
        return moved(tokens)[0].float().cpu()
    state = moved.new_state(tokens.shape[0])
    outputs, start = [], 0
    for size in chunks:
        outputs.append(moved(tokens[:, start : start + size], state)[0])
        start += size
    return torch.cat(outputs, dim=1).float().cpu()


CHUNKS = [30, 1, 1, 17, 47]  # adds up to TINY_MAX_LEN


@pytest.mark.parametrize("device", DEVICES)
def test_float32_logits_match_cpu(kind, device):
    model = make_tiny_model(kind)
    tokens = make_tokens(0, 2, TINY_MAX_LEN)
    cpu = logits_on(model, tokens, "cpu", torch.float32)
    torch.testing.assert_close(logits_on(model, tokens, device, torch.float32), cpu, atol=1e-3, rtol=0)
    torch.testing.assert_close(logits_on(model, tokens, device, torch.float32, CHUNKS), cpu, atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_logits_are_close_to_float32(kind, device):
    model = make_tiny_model(kind)
    tokens = make_tokens(1, 2, TINY_MAX_LEN)
    reference = logits_on(model, tokens, "cpu", torch.float32)
    assert_bfloat16_close(kind, logits_on(model, tokens, device, torch.bfloat16), reference)
    assert_bfloat16_close(kind, logits_on(model, tokens, device, torch.bfloat16, CHUNKS), reference)


def test_bfloat16_model_returns_bfloat16_logits(kind):
    model = copy.deepcopy(make_tiny_model(kind)).to(torch.bfloat16)
    with torch.no_grad():
        logits, _ = model(make_tokens(2, 1, 8), model.new_state(1))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()


def test_bfloat16_halves_the_softmax_kv_cache():
    model = make_tiny_model("softmax")
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert 2 * half.state_bytes_per_sequence(50) == model.state_bytes_per_sequence(50)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_points_and_draws_match_cpu(device):
    seeds, positions = torch.arange(64) * 7919, torch.arange(64) + 3
    cpu_points = row_points(seeds, positions)
    assert torch.equal(row_points(seeds.to(device), positions.to(device)).cpu(), cpu_points)
    logits = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.5 + i / 64, top_k=i % 5 * 10, top_p=0.5 + i % 3 / 4, seed=int(s))
        for i, s in enumerate(seeds)
    ]
    on_cpu = sample(logits, BatchSampling.from_params(params, "cpu"), positions)
    on_device = sample(logits.to(device), BatchSampling.from_params(params, device), positions.to(device))
    assert torch.equal(on_device.cpu(), on_cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_generate_draws_the_same_tokens_as_on_cpu(kind, device):
    model = shared_tiny_model(kind)
    prompts = random_bytes(4, 3, 4)
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.0), SamplingParams(top_k=30, seed=2)]
    on_cpu = generate(model, prompts, 24, BatchSampling.from_params(params, "cpu"))
    moved = copy.deepcopy(model).to(device)
    on_device = generate(moved, prompts.to(device), 24, BatchSampling.from_params(params, device))
    assert on_device.device.type == device
    assert torch.equal(on_device.cpu(), on_cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_load_model_onto_device_and_dtype(kind, device, tmp_path):
    model = make_tiny_model(kind)
    path = tmp_path / "m.safetensors"
    save_model(model, path)
    tokens = make_tokens(5, 1, 40)
    reference = logits_on(model, tokens, "cpu", torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        loaded, _ = load_model(path, device=device, dtype=dtype)
        assert loaded.device.type == device and loaded.dtype == dtype
        with torch.no_grad():
            logits = loaded(tokens.to(device))[0].float().cpu()
        if dtype == torch.float32:
            torch.testing.assert_close(logits, reference, atol=1e-3, rtol=0)
        else:
            assert_bfloat16_close(kind, logits, reference)
