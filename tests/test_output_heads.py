"""model/output_heads.py: the logistic-mixture output head for grey levels.

Its log-probabilities must be those of the discretized mixture itself, and a model
with it must keep every contract a categorical model keeps.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from model import ModelConfig, build_model
from model.config import ConfigError
from model.output_heads import MIN_LOG_SCALE, bin_edges, mixture_log_probs
from model.transformer import with_bos
from model.io.weights import load_model, save_model
from rnnserve_cli import parse_args
from training import train
from training.data import write_idx_images


def direct_bin_probs(logit_weights, means, log_scales) -> torch.Tensor:
    """The definition in float64: mixture weights times CDF differences over each level's bin."""
    edges = bin_edges().double()
    edges[0], edges[-1] = -math.inf, math.inf
    scales = torch.exp(log_scales.double().clamp(min=MIN_LOG_SCALE))
    cdf = torch.sigmoid((edges - means.double()[..., None]) / scales[..., None])
    return (torch.softmax(logit_weights.double(), -1)[..., None] * (cdf[..., 1:] - cdf[..., :-1])).sum(-2)


@pytest.mark.parametrize("scale_shift", [0.0, -3.0, -6.0])  # wide to a tenth of a bin
def test_log_probs_are_the_discretized_mixtures_own(scale_shift):
    gen = torch.Generator().manual_seed(1)
    weights, means, log_scales = (torch.randn(64, 10, generator=gen) for _ in range(3))
    means, log_scales = torch.tanh(means), log_scales + scale_shift
    got = mixture_log_probs(weights, means, log_scales)  # (64, 256)
    expected = direct_bin_probs(weights, means, log_scales)
    torch.testing.assert_close(got.exp().double(), expected, atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(got.logsumexp(-1), torch.zeros(64), atol=1e-5, rtol=0)
    levels = torch.randint(0, 256, (64,), generator=gen)
    at_levels = mixture_log_probs(weights, means, log_scales, levels=levels)  # only the observed levels
    torch.testing.assert_close(at_levels, got.gather(-1, levels[:, None])[:, 0], atol=1e-5, rtol=1e-5)


def test_far_tails_stay_finite_where_a_cdf_difference_would_be_zero():
    # One narrow component at level 0: level 255 is ~800 scales away, and a float32 difference of CDFs is 0 past ~17.
    log_probs = mixture_log_probs(torch.zeros(1, 1), torch.full((1, 1), -1.0), torch.full((1, 1), -6.0))
    assert torch.isfinite(log_probs).all()
    assert log_probs[0, 255] < -700 and log_probs[0].argmax() == 0
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(1), atol=1e-6, rtol=0)


def test_the_mixture_head_keeps_float32_under_a_bfloat16_autocast():
    """Training runs under bfloat16 autocast on CPUs with native bf16: the head's means must not be rounded to
    bfloat16 (about half a bin near +-1), or its sharp components cannot be placed."""
    head = mixture_model().head
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    levels = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        head.proj.bias[4:8] = torch.tensor([0.9961, -0.9961, 0.9883, 0.5])  # means near +-1
        head.proj.bias[8:] = -5.0  # narrower than a bin
        exact = head.log_probs_at(x, levels)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = head.log_probs_at(x, levels)
    torch.testing.assert_close(under_autocast, exact, atol=1e-5, rtol=1e-5)


def mixture_model(attention: str = "linear") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        attention=attention,
        task="mnist",
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        max_len=784,
        output_head="logistic_mixture",
        mixtures=4,
    )
    return build_model(cfg).eval()


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_decoding_token_by_token_equals_the_parallel_pass(attention):
    model = mixture_model(attention)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        parallel, _ = model(tokens)
        state = model.new_state(2)
        steps = torch.stack([model.decode_step(tokens[:, t], state) for t in range(40)], dim=1)
    torch.testing.assert_close(steps, parallel, atol=1e-4, rtol=0)
    torch.testing.assert_close(parallel.logsumexp(-1), torch.zeros(2, 40), atol=1e-5, rtol=0)
    with torch.no_grad():  # training and scoring read the observed tokens' log-probabilities only
        observed = model.token_log_probs(tokens)
        from_bos, _ = model(with_bos(tokens))  # (2, 40, 256)
    torch.testing.assert_close(observed, from_bos.gather(-1, tokens[..., None])[..., 0], atol=1e-5, rtol=0)


def test_a_mixture_model_round_trips_through_its_file(tmp_path: Path):
    model = mixture_model()
    save_model(model, tmp_path / "m.safetensors", {}, dtype=torch.float32)
    loaded, _ = load_model(tmp_path / "m.safetensors")
    assert loaded.config.output_head == "logistic_mixture" and loaded.config.mixtures == 4
    tokens = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0])


def test_training_a_mixture_model_lowers_its_loss(tmp_path: Path):
    images = torch.zeros(32, 28, 28, dtype=torch.uint8)
    images[:, 8:20, 10:18] = 255
    write_idx_images(tmp_path / "train-images-idx3-ubyte.gz", images.view(32, 784))
    write_idx_images(tmp_path / "t10k-images-idx3-ubyte.gz", images[:4].view(4, 784))
    argv = [
        "train",
        "--task",
        "mnist",
        "--attention",
        "linear",
        "--data",
        str(tmp_path),
        "--preset",
        "tiny",
        "--output-head",
        "logistic_mixture",
        "--mixtures",
        "3",
        "--steps",
        "80",
        "--lr",
        "5e-3",
        "--warmup-steps",
        "2",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--no-progress",
        "--checkpoint-every",
        "0",
        "--out",
        str(tmp_path / "m.safetensors"),
    ]
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # the initial weights train() starts from
    with torch.no_grad():
        before = float(train.sequence_loss(build_model(train.build_config(args)), images[:4].view(4, 784).long()))
    info = train.train(args)
    assert info["eval"]["bits_per_dim"] < 0.5 * before / math.log(2), before  # on those same 4 images


def test_a_mixture_head_for_text_is_refused_with_the_reason(tmp_path: Path, capsys):
    with pytest.raises(ConfigError, match="logistic_mixture models grey levels; task 'text' predicts bytes"):
        ModelConfig(task="text", output_head="logistic_mixture")
    (tmp_path / "t.txt").write_text("some text " * 50)
    argv = [
        "train",
        "--task",
        "text",
        "--attention",
        "linear",
        "--data",
        str(tmp_path / "t.txt"),
        "--preset",
        "tiny",
        "--output-head",
        "logistic_mixture",
        "--steps",
        "1",
        "--out",
        str(tmp_path / "m.safetensors"),
    ]
    assert train.run(parse_args(argv)) == 2
    assert "error: output_head logistic_mixture models grey levels" in capsys.readouterr().err
