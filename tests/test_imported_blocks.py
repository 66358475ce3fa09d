"""Softmax attention in imported models' blocks (model/architecture.py: a Llama's, a Qwen2's, a Mistral's): the
chunk-and-state contract of every kind holds for each (decoding token by token equals the parallel form, chunks
equal the whole, causality, row operations), and a sliding window hides exactly the positions before it.

The contract tests are collected again here with this module's `kind`, which names the variants
("softmax+llama"; tests/conftest.py reads the names). Fidelity to `transformers` is tests/test_hf_llama.py's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import BLOCK_VARIANTS, make_tiny_model, make_tokens
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


@pytest.fixture(scope="module", params=[f"softmax+{variant}" for variant in BLOCK_VARIANTS])
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
