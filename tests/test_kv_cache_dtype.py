"""A KV cache stored in another dtype than the model computes in (`--kv-cache-dtype`): softmax keeps its keys
and values in it; Reformer keeps its cache and linear and Linformer their recurrent sums as before; a bfloat16
cache holds the float32 keys and values rounded as they are written; compiled steps, the server and the
roofline count with it."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from benchmarks.roofline import token_cost
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.sampling import SamplingParams
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.io.weights import load_model
from server.engine.registry import load_models
from server.settings import SettingsError, build_settings
from training.data import write_idx_images
from training.evaluate import evaluate_mnist

from conftest import make_tiny_model
from server_support import (
    eager_generation,
    free_port,
    make_settings,
    save_tiny_model,
    stop_process,
    token_bytes,
    wait_healthy,
)

REPO = Path(__file__).resolve().parents[1]
STEPS = 12


def bfloat16_cache(model):
    model.kv_cache_dtype = torch.bfloat16
    return model


def state_dtypes(model) -> list[torch.dtype]:
    return [t.dtype for layer in model.new_state(2).layers for t in vars(layer).values()]


def test_a_softmax_cache_takes_the_cache_dtype_and_half_the_bytes():
    model = make_tiny_model("softmax")
    float_bytes = model.state_bytes_per_sequence()
    state = bfloat16_cache(model).new_state(2)
    assert model.cache_dtype() == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for layer in state.layers for t in (layer.k, layer.v))
    assert model.state_bytes_per_sequence() * 2 == float_bytes  # nothing but keys and values
    # the setting travels with the model to the processes that serve and compile it
    assert pickle.loads(pickle.dumps(model)).new_state(1).layers[0].k.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["reformer", "linear", "linformer"])
def test_other_kinds_keep_their_states_as_they_were(kind):
    model = make_tiny_model(kind)
    before, float_bytes = state_dtypes(model), model.state_bytes_per_sequence()
    bfloat16_cache(model)
    assert model.cache_dtype() is None
    assert state_dtypes(model) == before and model.state_bytes_per_sequence() == float_bytes


@torch.inference_mode()
def test_a_bfloat16_cache_holds_the_float32_keys_and_values_rounded_and_decodes_near_them():
    model = make_tiny_model("softmax", seed=4).eval()
    tokens = torch.randint(0, model.config.vocab_in, (3, STEPS), generator=torch.Generator().manual_seed(4))
    exact = EagerDecoder(model, model.new_state(3))
    bfloat = EagerDecoder(model, bfloat16_cache(model).new_state(3))
    want, got = [exact(tokens[:, t]) for t in range(STEPS)], [bfloat(tokens[:, t]) for t in range(STEPS)]
    # The first layer sees the same inputs on both sides: its cache is the float32 one, rounded as written.
    first_exact, first_bfloat = exact.state.layers[0], bfloat.state.layers[0]
    assert torch.equal(first_bfloat.k, first_exact.k.bfloat16()) and torch.equal(
        first_bfloat.v, first_exact.v.bfloat16()
    )
    assert not torch.equal(torch.stack(got), torch.stack(want))  # the rounding reaches the logits
    # only the cached numbers are rounded, to 8 significant bits: near the float32 steps and the parallel pass
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=0.05, rtol=0)
    parallel, _ = model(tokens, None)
    torch.testing.assert_close(torch.stack(got, 1), parallel, atol=0.05, rtol=0)


@torch.inference_mode()
def test_compiled_steps_over_a_bfloat16_cache_match_the_eager_ones():
    model = bfloat16_cache(make_tiny_model("softmax", seed=6).eval())
    eager = EagerDecoder(copy.deepcopy(model), model.new_state(3))  # PyTorch's operators, not the kernel
    compiled = CompiledDecoder(model, model.new_state(3))
    compiled.compile()
    assert compiled.compiled, compiled.log
    if compiled.log.kernels is None or not compiled.log.kernels.ok:
        pytest.skip(f"the CPU kernels did not load here ({compiled.log.kernels}): nothing reads bfloat16 in C++")
    assert compiled.state.layers[0].k.dtype == torch.bfloat16
    tokens = torch.randint(0, model.config.vocab_in, (3, STEPS), generator=torch.Generator().manual_seed(6))
    for t in range(STEPS):
        torch.testing.assert_close(compiled(tokens[:, t]), eager(tokens[:, t]), atol=1e-4, rtol=0)


def test_the_quality_benchmark_scores_through_the_cache_as_the_parallel_pass_does(tmp_path):
    from benchmarks import kv_cache_quality

    weights = save_tiny_model(tmp_path, "mnist-softmax", "softmax", "mnist")
    images = torch.randint(0, 256, (6, 784), generator=torch.Generator().manual_seed(1))
    write_idx_images(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    result = kv_cache_quality.measure(weights, tmp_path, count=6)
    model, _ = load_model(weights, "cpu")
    parallel = evaluate_mnist(model.eval(), images)["bits_per_dim"]
    # a float32 cache read chunk by chunk scores what one parallel pass does; a bfloat16 one, nearly
    assert result["bits_per_dim_float32_cache"] == pytest.approx(parallel, abs=1e-4)
    assert result["bits_per_dim_bfloat16_cache"] != result["bits_per_dim_float32_cache"]
    assert result["bits_per_dim_bfloat16_cache"] == pytest.approx(parallel, abs=0.02)
    with pytest.raises(SystemExit, match="an MNIST softmax model"):
        kv_cache_quality.measure(save_tiny_model(tmp_path, "mnist-linear", "linear", "mnist"), tmp_path, count=6)


def test_the_server_caches_in_bfloat16_when_asked_and_answers_what_eager_decoding_over_it_draws(tmp_path):
    softmax = save_tiny_model(tmp_path, "text-softmax", "softmax", "text")
    save_tiny_model(tmp_path, "text-linear", "linear", "text")
    port, log = free_port(), tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")} | {"OMP_NUM_THREADS": "1"}
    flags = ["--weights", str(tmp_path), "--port", str(port), "--kv-cache-dtype", "bfloat16", "--no-compile-decode"]
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", *flags], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log)
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        body = {
            "model": "text-softmax",
            "prompt": "abc",
            "max_tokens": 20,
            "temperature": 0.9,
            "seed": 3,
            "logprobs": 1,
        }
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    finally:
        stop_process(process)
    model, _ = load_model(softmax, "cpu")
    float_bytes = model.state_bytes_per_sequence()
    assert (cards["text-softmax"]["kv_cache_dtype"], cards["text-linear"]["kv_cache_dtype"]) == ("bfloat16", None)
    assert cards["text-softmax"]["state_bytes_per_sequence"] * 2 == float_bytes
    want_tokens, want_logprobs = eager_generation(
        bfloat16_cache(model), list(b"abc"), 20, SamplingParams(temperature=0.9, seed=3)
    )
    assert token_bytes(answer["logprobs"]["tokens"]) == want_tokens
    assert answer["logprobs"]["token_logprobs"] == pytest.approx(want_logprobs, abs=1e-4)


def test_an_unknown_cache_dtype_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("RNNSERVE_KV_CACHE_DTYPE", "fp8")
    with pytest.raises(SettingsError, match="--kv-cache-dtype / RNNSERVE_KV_CACHE_DTYPE: .*'bfloat16'.*'fp8'"):
        build_settings()


@pytest.mark.parametrize(
    "fields, warning",
    [
        ({"kv_cache_dtype": "bfloat16"}, "widened to torch.float32 by every step outside the CPU decode kernel"),
        ({"kv_cache_dtype": "float32", "dtype": "bfloat16"}, "more memory for nothing"),
        ({"kv_cache_dtype": "bfloat16", "compile_decode": True}, None),
    ],
)
def test_a_cache_dtype_that_cannot_help_is_warned_about_at_start_up(tmp_path, caplog, fields, warning):
    save_tiny_model(tmp_path, "text-softmax", "softmax", "text")
    with caplog.at_level(logging.WARNING, logger="rnnserve.registry"):
        [loaded] = load_models(make_settings(weights=tmp_path, device="cpu", **fields))
    warned = [r.getMessage() for r in caplog.records if r.name == "rnnserve.registry"]
    assert loaded.model.cache_dtype() == getattr(torch, fields["kv_cache_dtype"])
    assert (warning is None and not warned) or any(warning in w for w in warned), warned


def test_the_roofline_counts_a_softmax_cache_s_own_bytes():
    softmax, linear = (make_tiny_model(kind).config for kind in ("softmax", "linear"))
    for cfg, halves in ((softmax, True), (linear, False)):
        full, half = (token_cost(cfg, 100, 8, bytes_per_cached=n)["state_bytes_moved"] for n in (4, 2))
        assert half == (full / 2 if halves else full)
