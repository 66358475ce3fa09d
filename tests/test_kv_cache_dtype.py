"""A KV cache stored in another dtype than the model computes in (`--kv-cache-dtype`): softmax and Reformer
keep keys and values in it, recurrent sums stay float32; a bfloat16 cache holds the float32 keys and values
rounded as they are written; compiled steps and the server decode over it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from model.compiled_decode import CompiledDecoder
from model.sampling import SamplingParams
from model.step_decoders import EagerDecoder
from model.weights_io import load_model
from training.data import write_idx_images
from training.evaluate import evaluate_mnist

from conftest import make_tiny_model
from server_support import eager_generation, free_port, save_tiny_model, stop_process, token_bytes, wait_healthy

REPO = Path(__file__).resolve().parents[1]
CACHING_KINDS = ("softmax", "reformer")
STEPS = 12


def bfloat16_cache(model):
    model.kv_cache_dtype = torch.bfloat16
    return model


@pytest.mark.parametrize("kind", ["softmax", "reformer", "linear", "linformer"])
def test_only_caches_of_keys_and_values_take_the_cache_dtype(kind):
    model = make_tiny_model(kind)
    float_bytes = model.state_bytes_per_sequence()
    state = bfloat16_cache(model).new_state(2)
    cached = [t for layer in state.layers for t in (getattr(layer, "k", None), getattr(layer, "v", None))]
    if kind in CACHING_KINDS:
        assert model.cache_dtype() == torch.bfloat16
        assert all(t.dtype == torch.bfloat16 for t in cached)
        assert model.state_bytes_per_sequence() < float_bytes
    else:  # recurrent sums: float32 whatever is asked
        assert model.cache_dtype() is None
        assert all(t.dtype == torch.float32 for layer in state.layers for t in vars(layer).values())
        assert model.state_bytes_per_sequence() == float_bytes
    if kind == "softmax":  # nothing but keys and values: half the bytes
        assert model.state_bytes_per_sequence() * 2 == float_bytes


@pytest.mark.parametrize("kind", CACHING_KINDS)
@torch.inference_mode()
def test_a_bfloat16_cache_holds_the_float32_keys_and_values_rounded_and_decodes_near_them(kind):
    model = make_tiny_model(kind, seed=4).eval()
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
    eager, compiled = EagerDecoder(model, model.new_state(3)), CompiledDecoder(model, model.new_state(3))
    compiled.compile()
    assert compiled.compiled, compiled.log
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
    with pytest.raises(SystemExit, match="a kind with a KV cache"):
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


def test_an_unknown_cache_dtype_is_refused_naming_the_choices(tmp_path):
    save_tiny_model(tmp_path, "text-softmax", "softmax", "text")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")} | {"RNNSERVE_KV_CACHE_DTYPE": "fp8"}
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--weights", str(tmp_path), "--port", str(free_port())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--kv-cache-dtype / RNNSERVE_KV_CACHE_DTYPE" in done.stderr and "bfloat16" in done.stderr, done.stderr
