"""Hybrid attention (model/attention/hybrid.py): its parallel form is the formula written out query by query;
with the window's share at one it is softmax over a sliding window (the softmax kind's own, same weights); its
state holds W keys and values and the linear sums whatever the length. Decoding = parallel, chunks = whole,
causality and row operations are the contract tests every kind passes (tests/test_model_contract.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, make_tokens
from model.attention.head_shapes import split_heads


def reference(attn, x: torch.Tensor) -> torch.Tensor:
    """The module docstring's formula, one query and one key at a time. x (B, T, C) -> (B, T, C)."""
    q, k, v = (split_heads(t, attn.n_heads).float() for t in attn.qkv(x).chunk(3, dim=-1))
    phi_q, phi_k = attn.feature_map(q), attn.feature_map(k)
    b, h, t, d = q.shape
    g = torch.sigmoid(attn.mix.float())
    out = torch.zeros_like(q)
    for i in range(t):
        window = range(max(0, i - attn.window + 1), i + 1)
        scores = torch.stack([(q[:, :, i] * k[:, :, j]).sum(-1) / d**0.5 for j in window], -1)  # (B, H, w)
        top = scores.max(-1).values
        numerator, denominator = torch.zeros(b, h, d), torch.zeros(b, h)
        for n, j in enumerate(window):
            a = g * torch.exp(scores[..., n] - top)
            numerator, denominator = numerator + a[..., None] * v[:, :, j], denominator + a
        for j in range(0, i - attn.window + 1):
            a = (1 - g) * (phi_q[:, :, i] * phi_k[:, :, j]).sum(-1)
            numerator, denominator = numerator + a[..., None] * v[:, :, j], denominator + a
        out[:, :, i] = numerator / (denominator[..., None] + attn.eps)
    return attn.proj(out.transpose(1, 2).reshape(b, t, h * d))


@pytest.mark.parametrize("feature_map", ["elu", "hedgehog"])
@pytest.mark.parametrize("length", [3, 5, 10, 17])  # shorter than the window, one block, two, a padded last block
def test_the_parallel_form_is_the_formula_query_by_query(feature_map, length):
    model = make_tiny_model("hybrid", hybrid_window=5, hybrid_feature_map=feature_map)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.mix.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))  # a different share per head
        x = torch.randn(2, length, model.config.d_model, generator=torch.Generator().manual_seed(0))
        got, _ = attn(x, torch.zeros(2, dtype=torch.long), None)
        torch.testing.assert_close(got, reference(attn, x), atol=1e-5, rtol=0)


def test_with_the_window_s_whole_share_it_is_softmax_over_a_sliding_window():
    hybrid = make_tiny_model("hybrid", hybrid_window=6)
    softmax = make_tiny_model("softmax", sliding_window=6)
    with torch.no_grad():
        softmax.load_state_dict({k: v for k, v in hybrid.state_dict().items() if "mix" not in k}, strict=True)
        for block in hybrid.blocks:
            block.attn.mix.fill_(40.0)  # g = 1 to float32's precision: the linear part has no weight
        tokens = make_tokens(3, 2, 50)
        torch.testing.assert_close(hybrid(tokens)[0], softmax(tokens)[0], atol=1e-4, rtol=0)


def test_the_state_holds_the_window_and_the_sums_whatever_the_length():
    model = make_tiny_model("hybrid", hybrid_window=8)
    cfg = model.config
    expected = cfg.n_layers * 4 * cfg.n_heads * (2 * 8 * cfg.d_head + cfg.d_head * cfg.d_head + cfg.d_head)
    assert model.state_bytes_per_sequence(10) == model.state_bytes_per_sequence(90) == expected
