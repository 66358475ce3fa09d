"""Imported models' blocks (model/architecture.py: a Llama's, a Qwen2's, a Mistral's) under softmax attention and
under the kinds that implement them to linearize such a model (linear and hybrid: rotary positions, grouped-query
attention, no biases): the chunk-and-state contract of every kind holds for each (decoding token by token equals
the parallel form, chunks equal the whole, causality, row operations), a sliding window hides exactly the
positions before it, the state holds only the key and value heads, and the kinds that implement none of it
refuse it naming the field.

The contract tests are collected again here with this module's `kind`, which names the variants
("softmax+llama", "hybrid+qwen2+hedgehog"; tests/conftest.py reads the names). Fidelity to `transformers` is
tests/test_hf_llama.py's; linearized twins of a `transformers` Llama are tests/test_linearized_llama.py's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import BLOCK_VARIANTS, make_tiny_config, make_tiny_model, make_tokens
from model.config import ConfigError
from test_model_contract import (
    test_changing_a_token_never_changes_earlier_outputs,  # noqa: F401
    test_chunk_past_max_len_raises_and_leaves_the_state_usable,
    test_chunked_logits_equal_parallel_logits,
    test_later_positions_see_earlier_tokens_through_attention,
    test_parallel_chunk_up_to_max_len_runs_and_past_it_raises,
    test_token_by_token_decoding_equals_parallel_over_full_max_len,
)
from test_model_state import (
    test_copied_rows_generate_identically_and_spare_other_rows,  # noqa: F401
    test_decoding_a_view_of_the_live_rows_matches_and_spares_the_rest,
    test_reset_row_behaves_like_a_fresh_sequence_and_spares_other_rows,
    test_rows_at_different_positions_match_their_own_sequences,
)


# Mistral's sliding window is softmax's alone; the learned maps run per key head in grouped-query attention.
LINEARIZED_VARIANTS = [
    f"{kind}+{variant}{feature_map}"
    for kind in ("linear", "hybrid")
    for variant in ("llama", "qwen2")
    for feature_map in ("", "+hedgehog")
]


@pytest.fixture(scope="module", params=[*(f"softmax+{variant}" for variant in BLOCK_VARIANTS), *LINEARIZED_VARIANTS])
def kind(request) -> str:
    return request.param


def test_a_sliding_window_hides_exactly_the_positions_before_it():
    model = make_tiny_model("softmax+mistral")  # a window of 10
    tokens = make_tokens(3, 1, 40)
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens)[0], model(changed)[0]
    # One layer's window reaches 9 positions back; two layers reach 18: position 5 is out of reach from 24 on.
    assert (after[0, 5:24] - before[0, 5:24]).abs().max() > 1e-3
    torch.testing.assert_close(after[0, 24:], before[0, 24:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", list(BLOCK_VARIANTS))
def test_the_cache_holds_only_the_key_and_value_heads(variant):
    model = make_tiny_model(f"softmax+{variant}")
    cache = model.new_state(3).layers[0]
    heads = model.config.n_kv_heads
    assert heads < model.config.n_heads and cache.k.shape == (3, heads, model.config.max_len, model.config.d_head)
    assert model.state_bytes_per_sequence() == model.config.n_layers * 2 * heads * model.config.max_len * 8 * 4


@pytest.mark.parametrize("kind", LINEARIZED_VARIANTS)
def test_linearized_states_hold_sums_per_key_head(kind):
    """S and Z (and the hybrid's window) per key head: the state shrinks by the group size."""
    model = make_tiny_model(kind, hybrid_window=8)
    config, layer = model.config, model.new_state(3).layers[0]
    kv, features = config.n_kv_heads, model.blocks[0].attn.features
    assert kv < config.n_heads
    sums = layer.sz_t if config.attention == "linear" else layer.s
    assert sums.shape[:2] == (3, kv) and features in sums.shape[2:]
    if config.attention == "hybrid":
        assert layer.k.shape == layer.v.shape == (3, kv, 8, config.d_head)
    full = make_tiny_model(kind, hybrid_window=8, kv_heads=0)
    assert model.state_bytes_per_sequence() * config.n_heads == full.state_bytes_per_sequence() * kv


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_a_softmax_llama_s_parameters_are_its_linearized_twin_s_by_name_and_shape(kind):
    softmax = make_tiny_model("softmax+llama")
    twin = make_tiny_model(f"{kind}+llama+hedgehog")
    theirs = {name: p.shape for name, p in twin.named_parameters()}
    assert {name: p.shape for name, p in softmax.named_parameters()}.items() <= theirs.items()
    biases = [name for name in theirs if name.endswith(("attn.qkv.bias", "attn.proj.bias"))]
    assert not biases  # a Llama's projections have none
    qwen2 = make_tiny_model(f"{kind}+qwen2")
    assert qwen2.blocks[0].attn.qkv.bias is not None and qwen2.blocks[0].attn.proj.bias is None


def test_rotary_positions_turn_linear_queries_and_keys_before_the_feature_map():
    """Without its rotation a linear Llama computes other outputs: rotary positions reach the linear sums."""
    model = make_tiny_model("linear+llama")
    tokens = make_tokens(5, 1, 30)
    with torch.no_grad():
        turned = model(tokens)[0]
        for block in model.blocks:
            block.attn.rotary = None
        plain = model(tokens)[0]
    assert (turned[0, 1:] - plain[0, 1:]).abs().max() > 1e-3
    torch.testing.assert_close(turned[0, 0], plain[0, 0])  # position 0 is not turned


@pytest.mark.parametrize("kind", ["linformer", "reformer"])
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({}, "pos_encoding rotary"),
        ({"pos_encoding": "learned"}, "kv_heads 2"),
        ({"pos_encoding": "learned", "kv_heads": 0}, "qkv_bias False"),
        ({"pos_encoding": "learned", "kv_heads": 0, "qkv_bias": True}, "attn_out_bias False"),
    ],
)
def test_kinds_that_implement_no_imported_block_refuse_it_naming_the_field(kind, change, field):
    with pytest.raises(ConfigError, match=f"^{field}: {kind} attention does not implement"):
        make_tiny_config(f"{kind}+llama", **change)
