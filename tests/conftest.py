"""Shared fixtures for the model-core tests: tiny configs and models, random tokens.

Tiny means d_model 32, 2 layers, 4 heads and a short max_len, so every test
file runs in seconds on a 2-core CPU.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Callable

import pytest
import torch
from torch import nn

from model import ModelConfig, Transformer, build_model
from model.attention.feature_maps import ProjectedFeatureMap
from model.attention.classes import attention_kinds, kinds_where
from model.transformer import with_bos

# Every registered kind, and groups by what their capabilities declare: tests parametrised over a
# group check that the declaration holds (e.g. a constant-size state really does not grow).
KINDS = attention_kinds()
CONSTANT_STATE_KINDS = kinds_where(lambda c: c.constant_state)
GROWING_STATE_KINDS = kinds_where(lambda c: not c.constant_state)
PADDABLE_KINDS = kinds_where(lambda c: c.paddable)
GRAPHABLE_KINDS = kinds_where(lambda c: c.graphable)
COMPILABLE_KINDS = kinds_where(lambda c: c.compilable)
TINY_MAX_LEN = 96  # above the linear kind's 64-token block, so several blocks are exercised


# Loose bfloat16 tolerances on logits of scale ~4 (bfloat16 keeps ~3 significant digits).
BF16_MAX_ERROR = 0.1
BF16_MEAN_ERROR = 0.03
# Reformer hashes bfloat16-rounded keys: a key near a bucket boundary changes bucket
# (about 0.2% of layer-0 hashes here), which moves every later query of both buckets.
# So only the average error is tight for it; single logits may move by up to ~0.7.
REFORMER_BF16_MEAN_ERROR = 0.05
REFORMER_BF16_MAX_ERROR = 1.5


# Linear attention with each learned feature map (model/attention/feature_maps.py), named as `make_tiny_config` reads
# them.
FEATURE_MAP_VARIANTS = ("linear+t2r", "linear+hedgehog")


# Imported models' blocks (model/architecture.py): a Llama's (RMSNorm, SwiGLU, rotary positions with Llama 3's
# scaling, two query heads per key head, no biases), a Qwen2's (q/k/v biases, one key head) and a Mistral's
# (a sliding window shorter than the tiny context).
LLAMA_BLOCK = dict(
    norm="rms",
    feed_forward="swiglu",
    pos_encoding="rotary",
    kv_heads=2,
    qkv_bias=False,
    attn_out_bias=False,
    ff_bias=False,
    head_bias=False,
    rope_scaling="llama3",
    rope_factor=4.0,
    rope_original_max_len=32,
)
BLOCK_VARIANTS = {
    "llama": LLAMA_BLOCK,
    "qwen2": {**LLAMA_BLOCK, "kv_heads": 1, "qkv_bias": True, "rope_scaling": "none"},
    "mistral": {**LLAMA_BLOCK, "sliding_window": 10, "rope_scaling": "none"},
}


def make_tiny_config(kind: str, **overrides) -> ModelConfig:
    """A tiny config of `kind` ("linear+hedgehog": linear attention with that feature map; "softmax+llama": softmax
    with a Llama's block; "hybrid+qwen2+t2r": both); keyword overrides replace any field."""
    kind, *variants = kind.split("+")
    for variant in reversed(variants):
        if variant in BLOCK_VARIANTS:
            overrides = {**BLOCK_VARIANTS[variant], **overrides}
        else:  # F != the head size
            overrides = {f"{kind}_feature_map": variant, f"{kind}_features": 6, **overrides}
    fields = dict(
        attention=kind,
        task="text",
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_len=TINY_MAX_LEN,
        dropout=0.0,
        pos_encoding="learned",
        linformer_k=8,
        reformer_rounds=2,
        reformer_buckets=4,  # few buckets: each holds several keys
        reformer_local_window=8,  # shorter than max_len: the window slides
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def sharpen_(model: Transformer, seed: int) -> Transformer:
    """Re-draw weights at unit scale, in place.

    The training init (std 0.02) makes attention nearly uniform and barely
    visible in the logits, so a wrong attention output could hide under a
    1e-4 tolerance. Unit-scale weights make every position matter.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) / math.sqrt(module.in_features))
                if module.bias is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
            elif isinstance(module, ProjectedFeatureMap):  # learned feature maps: (H, P, D) per-head projections
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) / math.sqrt(module.weight.shape[2]))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
    return model


def make_tiny_model(kind: str, seed: int = 0, **overrides) -> Transformer:
    """A tiny eval-mode float32 model with unit-scale weights, deterministic in `seed`."""
    torch.manual_seed(seed)  # Linformer E/F and Reformer rotations are drawn at build time
    return sharpen_(build_model(make_tiny_config(kind, **overrides)), seed).eval()


@functools.cache
def shared_tiny_model(kind: str) -> Transformer:
    """`make_tiny_model(kind)`, made once per session for the tests that only decode with it: its compiled
    decoders then compile once (dynamo compiles again for each model's decode twin, model/kernels/packed_linear.py,
    whose packed weights are a snapshot). Never change it in place (weights, dtype, device, mode):
    `copy.deepcopy` it first."""
    return make_tiny_model(kind)


def random_bytes(seed: int, batch: int, length: int) -> torch.Tensor:
    """(batch, length) random tokens 0..255, deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=gen)


def make_tokens(seed: int, batch: int, length: int) -> torch.Tensor:
    """(batch, length) BOS-shifted random bytes: the input a model sees at a sequence start."""
    return with_bos(random_bytes(seed, batch, length))


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Run torch on one thread during each test, whatever an earlier one set.

    Tiny tensors gain nothing from a second thread, and on the shared 2-core
    machine intra-op threads spin while waiting for a busy core (the slowdown
    is measured in benchmarks/results/NOTES.md, "Measurements behind design choices").
    Per test, not per session: in-process `rnnserve train` sets its --threads
    (every core by default), which would otherwise hold for every later test.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", params=KINDS)
def kind(request) -> str:
    """Each registered attention kind."""
    return request.param


# Session-scoped factories: hypothesis tests may use them (no per-example fixture state).
@pytest.fixture(scope="session")
def tiny_config() -> Callable[..., ModelConfig]:
    return make_tiny_config


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., Transformer]:
    return make_tiny_model


@pytest.fixture(scope="session")
def tokens() -> Callable[[int, int, int], torch.Tensor]:
    return make_tokens


def assert_bfloat16_close(kind: str, got: torch.Tensor, reference: torch.Tensor) -> None:
    error = (got - reference).abs()
    if kind == "reformer":
        assert error.mean() < REFORMER_BF16_MEAN_ERROR
        assert error.max() < REFORMER_BF16_MAX_ERROR
    else:
        assert error.mean() < BF16_MEAN_ERROR
        assert error.max() < BF16_MAX_ERROR


# Modules whose tests start servers, browsers, Ray clusters, compiles or trainings: `make test-fast` leaves them
# out (`pytest -m "not slow"`); `make test`, what CI runs, runs everything.
SLOW_MODULES = frozenset(
    {
        "test_api_errors",
        "test_background_start",
        "test_bench",
        "test_chat",
        "test_compile_child",
        "test_compiled_decode",
        "test_completions",
        "test_cpu_kernels",
        "test_deploy",
        "test_distillation",
        "test_drain",
        "test_engine_admission",
        "test_engine_process",
        "test_engine_restart",
        "test_eval_checkpoints",
        "test_kv_cache_dtype",
        "test_linearized_llama",
        "test_openai_client",
        "test_openapi_contract",
        "test_playground",
        "test_playground_browser",
        "test_prebuild",
        "test_ray",
        "test_ray_deploy",
        "test_readme",
        "test_server_images",
        "test_engine_pool",
        "test_server_particles",
        "test_server_process",
        "test_server_misc",
        "test_server_text",
        "test_threads",
        "test_training",
    }
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config) -> None:
    """Servers the tests start run one engine process a model, as they did before --workers (each worker
    spawns a process and compiles; on a 2-core machine the default would double both). The tests of the
    workers, tests/test_engine_pool.py, set --workers themselves or clear this to see the default."""
    os.environ.setdefault("RNNSERVE_WORKERS", "1")
