"""Linear attention with learned feature maps (T2R, Hedgehog): the chunk-and-state contract of every kind holds
for each (decoding token by token equals the parallel form, chunks equal the whole), the state stays
(H, D + 1, F) whatever the length, and what a softmax model's weights give them at the start.

The contract tests are collected again here with this module's `kind`, which names the variants
("linear+hedgehog": linear attention with that map, F != the head size; tests/conftest.py reads the names).
"""

from __future__ import annotations

import pytest
import torch

from model.attention.feature_maps import feature_count
from model.attention.linear import LinearAttention

from conftest import FEATURE_MAP_VARIANTS, make_tiny_model, random_bytes
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


@pytest.fixture(scope="module", params=FEATURE_MAP_VARIANTS)
def kind(request) -> str:
    return request.param


def test_the_state_has_f_features_per_head_and_does_not_grow(kind):
    model = make_tiny_model(kind)
    attn = model.blocks[0].attn
    assert isinstance(attn, LinearAttention)
    cfg = model.config
    f = feature_count(cfg.linear_feature_map, cfg.d_head, cfg.linear_features)
    assert f == {"t2r": 6, "hedgehog": 12}[cfg.linear_feature_map] and f != cfg.d_head
    state = model.new_state(2)
    before = [t.shape for t in state.layers[0].tensors()]
    assert before == [torch.Size([2, cfg.n_heads, cfg.d_head + 1, f])]
    with torch.inference_mode():
        model(random_bytes(0, 2, 40), state)
    assert [t.shape for t in state.layers[0].tensors()] == before
    assert model.state_bytes_per_sequence(1) == model.state_bytes_per_sequence(200)


def test_the_learned_maps_own_parameters_and_elu_none(kind):
    names = {name for name, _ in make_tiny_model(kind).named_parameters() if ".feature_map." in name}
    assert names == {f"blocks.{i}.attn.feature_map.{p}" for i in (0, 1) for p in ("weight", "bias")}
    assert not [name for name, _ in make_tiny_model("linear").named_parameters() if ".feature_map." in name]


def test_hedgehog_starts_as_softmax_of_the_query_and_of_its_negation():
    attn = LinearAttention(make_tiny_model("linear+hedgehog", linear_features=0).config)  # P = D: the identity
    x = torch.randn(2, attn.n_heads, 5, attn.proj.in_features // attn.n_heads)
    torch.testing.assert_close(attn.feature_map(x), torch.cat([x.softmax(-1), (-x).softmax(-1)], dim=-1))
