"""`rnnserve eval --attention-share`: the linear part's share of a hybrid model's attention normaliser, per layer
and head, over queries that have keys older than the window (training/attention_share.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.transformer import build_model
from model.io.weights import read_metadata, save_model
from rnnserve_cli import main
from training.attention_share import attention_share

from conftest import make_tiny_config, sharpen_

WINDOW = 4
LENGTH = 16


def hybrid(kind: str = "hybrid+qwen2+t2r", mix: float | None = None, seed: int = 3):
    model = sharpen_(build_model(make_tiny_config(kind, max_len=LENGTH, hybrid_window=WINDOW)), seed=seed).eval()
    if mix is not None:
        with torch.no_grad():
            for block in model.blocks:
                block.attn.mix.fill_(mix)
    return model


def batches(model, count: int = 2, batch: int = 3):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, model.config.vocab_size, (batch, LENGTH), generator=gen) for _ in range(count)]


# Maps whose features are positive: every older key weighs something (t2r's ReLU can give a query no linear mass)
@pytest.mark.parametrize("kind", ["hybrid+hedgehog", "hybrid+qwen2+hedgehog", "hybrid+elu"])
def test_a_window_weighted_fully_leaves_the_linear_part_nothing_and_the_reverse_everything(kind):
    window_only = attention_share(hybrid(kind, mix=40.0), batches(hybrid(kind)))
    linear_only = attention_share(hybrid(kind, mix=-40.0), batches(hybrid(kind)))
    for result in (window_only, linear_only):
        assert len(result["linear_share"]) == 2 and all(len(layer) == 4 for layer in result["linear_share"])
    assert max(share for layer in window_only["linear_share"] for share in layer) < 1e-6
    assert min(share for layer in linear_only["linear_share"] for share in layer) > 1 - 1e-6
    # the model's own sequence: BOS and the tokens, so each row has LENGTH + 1 - WINDOW queries past the window
    model = hybrid(kind)
    rows_seen = sum(b.shape[0] for b in batches(model))
    assert window_only["queries_per_head"] == rows_seen * (model_length(model, batches(model)[0]) - WINDOW)


def model_length(model, tokens: torch.Tensor) -> int:
    """How many positions the model's forward pass attends over for `tokens`."""
    from training.attention_share import layer_inputs

    with torch.no_grad():
        return layer_inputs(model, tokens)[0].shape[1]


def test_an_even_mix_splits_the_normaliser_between_the_parts():
    result = attention_share(hybrid(mix=0.0), batches(hybrid()))
    shares = [share for layer in result["linear_share"] for share in layer]
    assert all(0.0 < share < 1.0 for share in shares)
    assert result["mean_linear_share"] == pytest.approx(sum(shares) / len(shares))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("to be or not to be, that is the question. " * 60, encoding="utf-8")
    return path


def test_eval_prints_and_stores_each_layer_and_head_s_share(tmp_path, corpus, capsys):
    path = tmp_path / "hybrid.safetensors"
    save_model(hybrid(mix=-2.0), path)
    flags = ["--data", str(corpus), "--attention-share", "--limit", "5", "--no-progress", "--device", "cpu"]
    assert main(["eval", str(path), *flags, "--json", "--store"]) == 0
    result = json.loads(capsys.readouterr().out)[str(path)]
    assert result["window"] == WINDOW and result["queries_per_head"] == 5 * (LENGTH - WINDOW)
    assert 0.0 < result["mean_linear_share"] < 1.0
    assert read_metadata(path)[1]["eval"]["attention_share"] == result
    assert main(["eval", str(path), *flags]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == str(path) and table[2].startswith("| layer | head 0 | head 1 | head 2 | head 3 | mean |")
    assert table[-2] == f"mean over layers and heads: {result['mean_linear_share']:.3f}"


def test_eval_refuses_the_share_of_a_model_that_is_not_a_hybrid(tmp_path, corpus, capsys):
    path = tmp_path / "linear.safetensors"
    save_model(build_model(make_tiny_config("linear", max_len=LENGTH)), path)
    assert main(["eval", str(path), "--data", str(corpus), "--attention-share", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"rnnserve eval: error: {path} is a linear model; --attention-share measures a hybrid model's linear part "
        "against its window"
    )
