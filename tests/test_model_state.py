"""Decoding states: rows at different positions, row operations, memory.

The engine batches sequences at different positions in one state and resets,
copies and writes single rows; each row must behave exactly like its own
sequence run alone, and the other rows must not notice.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import (
    CONSTANT_STATE_KINDS,
    GROWING_STATE_KINDS,
    KINDS,
    TINY_MAX_LEN,
    make_tiny_model,
    make_tokens,
    random_bytes,
)

TOLERANCE = 1e-4


@torch.no_grad()
def parallel_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, None)[0]


def snapshot(state, rows: list[int]) -> list[torch.Tensor]:
    """Copies of the given rows of every state tensor, and their lengths."""
    tensors = [t[rows].clone() for layer in state.layers for t in layer.tensors()]
    return tensors + [state.lengths[rows].clone()]


def assert_rows_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert torch.equal(b, a)


@torch.no_grad()
def prefill_alone(model, tokens: torch.Tensor):
    """A batch-1 state holding `tokens` (1, T), fed in two chunks."""
    state = model.new_state(1)
    half = max(1, tokens.shape[1] // 2)
    model(tokens[:, :half], state)
    if tokens.shape[1] > half:
        model(tokens[:, half:], state)
    return state


# ---------------------------------------------------------------- continuous batching


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(1, TINY_MAX_LEN - 4), min_size=3, max_size=3),
    order=st.permutations([0, 1, 2]),
    step=st.integers(1, 3),
)
@torch.no_grad()
def test_rows_at_different_positions_match_their_own_sequences(kind, lengths, order, step):
    """Rows prefilled alone (write_rows) then advanced together by `step` tokens."""
    model = make_tiny_model(kind)
    sequences = [make_tokens(100 + i, 1, n + step) for i, n in enumerate(lengths)]
    state = model.new_state(3)
    for row, seq in zip(order, sequences):
        state.write_rows([row], prefill_alone(model, seq[:, :-step]))
    assert state.lengths[order].tolist() == lengths
    nxt = torch.empty(3, step, dtype=torch.long)
    for row, seq in zip(order, sequences):
        nxt[row] = seq[0, -step:]
    logits, _ = model(nxt, state)  # step 1: one decode step; more: a mixed-position chunk
    for row, seq in zip(order, sequences):
        expected = parallel_logits(model, seq)[0, -step:]
        torch.testing.assert_close(logits[row], expected, atol=TOLERANCE, rtol=0)
        assert int(state.lengths[row]) == seq.shape[1]


@torch.no_grad()
def test_decoding_several_steps_with_rows_at_different_positions(kind):
    model = make_tiny_model(kind)
    lengths, steps = [5, 31, 70], 12
    sequences = [make_tokens(200 + n, 1, n + steps) for n in lengths]
    state = model.new_state(3)
    for row, seq in enumerate(sequences):
        state.write_rows([row], prefill_alone(model, seq[:, :-steps]))
    decoded = []
    for s in range(steps):
        column = torch.cat([seq[:, lengths[row] + s] for row, seq in enumerate(sequences)])
        decoded.append(model(column[:, None], state)[0])
    decoded = torch.cat(decoded, dim=1)  # (3, steps, V)
    for row, seq in enumerate(sequences):
        torch.testing.assert_close(decoded[row], parallel_logits(model, seq)[0, -steps:], atol=TOLERANCE, rtol=0)


# ---------------------------------------------------------------- reset_rows


@torch.no_grad()
def test_reset_row_behaves_like_a_fresh_sequence_and_spares_other_rows(kind):
    model = make_tiny_model(kind)
    old = make_tokens(1, 3, 20)
    state = model.new_state(3)
    model(old, state)
    untouched = snapshot(state, [0, 2])
    state.reset_rows([1])
    assert state.lengths.tolist() == [20, 0, 20]
    assert_rows_unchanged(untouched, snapshot(state, [0, 2]))
    # Row 1 now starts a new sequence while rows 0 and 2 continue theirs.
    fresh = make_tokens(2, 1, 9)
    continued = random_bytes(3, 3, 9)
    continued[1] = fresh[0]
    logits, _ = model(continued, state)
    torch.testing.assert_close(logits[1], parallel_logits(model, fresh)[0], atol=TOLERANCE, rtol=0)
    for row in (0, 2):
        whole = torch.cat([old[row], continued[row]])[None]
        torch.testing.assert_close(logits[row], parallel_logits(model, whole)[0, 20:], atol=TOLERANCE, rtol=0)


@torch.no_grad()
def test_reset_row_equals_a_newly_allocated_row(kind):
    model = make_tiny_model(kind)
    state = model.new_state(2)
    model(make_tokens(4, 2, 33), state)
    state.reset_rows(torch.tensor([0]))
    fresh = model.new_state(1)
    for used, new in zip(snapshot(state, [0]), snapshot(fresh, [0])):
        assert torch.equal(used, new)


# ---------------------------------------------------------------- copy_rows


@torch.no_grad()
def test_copied_rows_generate_identically_and_spare_other_rows(kind):
    model = make_tiny_model(kind)
    state = model.new_state(4)
    model(make_tokens(5, 4, 17), state)
    untouched = snapshot(state, [0, 3])
    state.copy_rows([1], [2])
    assert_rows_unchanged(untouched, snapshot(state, [0, 3]))
    for copy, original in zip(snapshot(state, [2]), snapshot(state, [1])):
        assert torch.equal(copy, original)
    # Greedy decoding from identical rows: identical tokens and logits.
    tokens = random_bytes(6, 4, 1)
    tokens[2] = tokens[1]
    generated = []
    for _ in range(10):
        logits, _ = model(tokens, state)
        assert torch.equal(logits[2], logits[1])
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(tokens)
    generated = torch.cat(generated, dim=1)
    assert torch.equal(generated[2], generated[1])
    assert not torch.equal(generated[0], generated[1])  # other rows follow their own sequences


@torch.no_grad()
def test_copy_rows_into_a_row_at_another_position(kind):
    """n > 1 samples: one prompt's prefill copied over rows that held longer sequences."""
    model = make_tiny_model(kind)
    prompt = make_tokens(7, 1, 6)
    state = model.new_state(3)
    model(make_tokens(8, 3, 40), state)
    state.reset_rows([0])
    model_input = random_bytes(9, 3, 6)
    model_input[0] = prompt[0]
    model(model_input, state)  # row 0 holds the prompt, rows 1, 2 are at 46
    state.copy_rows([0, 0], [1, 2])
    assert state.lengths.tolist() == [6, 6, 6]
    nxt = random_bytes(10, 1, 1).expand(3, 1)
    whole = torch.cat([prompt, nxt[:1]], dim=1)
    logits, _ = model(nxt, state)
    for row in range(3):
        torch.testing.assert_close(logits[row, 0], parallel_logits(model, whole)[0, -1], atol=TOLERANCE, rtol=0)


# ---------------------------------------------------------------- slice views


@torch.no_grad()
def test_prefill_through_a_slice_writes_into_the_batch_state(kind):
    model = make_tiny_model(kind)
    state = model.new_state(3)
    model(make_tokens(11, 3, 8), state)
    untouched = snapshot(state, [0, 2])
    state.reset_rows([1])
    prompt = make_tokens(12, 1, 15)
    model(prompt, state.slice(1, 2))
    assert state.lengths.tolist() == [8, 15, 8]
    assert_rows_unchanged(untouched, snapshot(state, [0, 2]))
    nxt = random_bytes(13, 3, 1)
    logits, _ = model(nxt, state)
    whole = torch.cat([prompt, nxt[1:2]], dim=1)
    torch.testing.assert_close(logits[1, 0], parallel_logits(model, whole)[0, -1], atol=TOLERANCE, rtol=0)


@torch.no_grad()
def test_decoding_a_view_of_the_live_rows_matches_and_spares_the_rest(kind):
    """The engine decodes `state.slice(0, n)`: the live rows of a compacted batch."""
    model = make_tiny_model(kind)
    history = make_tokens(14, 4, 12)
    state = model.new_state(4)
    model(history, state)
    spare = snapshot(state, [2, 3])
    live = state.slice(0, 2)
    steps = random_bytes(15, 2, 5)
    decoded = torch.cat([model(steps[:, s : s + 1], live)[0] for s in range(5)], dim=1)
    assert state.lengths.tolist() == [17, 17, 12, 12]
    assert_rows_unchanged(spare, snapshot(state, [2, 3]))
    whole = torch.cat([history[:2], steps], dim=1)
    torch.testing.assert_close(decoded, parallel_logits(model, whole)[:, 12:], atol=TOLERANCE, rtol=0)


# ---------------------------------------------------------------- memory


def _feed(model, state, total: int, chunk: int) -> None:
    with torch.no_grad():
        for start in range(0, total, chunk):
            logits, _ = model(make_tokens(start, state.batch_size, min(chunk, total - start)), state)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("kind", CONSTANT_STATE_KINDS)
def test_constant_size_state_does_not_grow_from_16_to_16384_tokens(kind):
    model = make_tiny_model(kind, max_len=16384, pos_encoding="sinusoidal")
    short, long = model.new_state(1), model.new_state(1)
    pointers = [t.data_ptr() for layer in long.layers for t in layer.tensors()]
    _feed(model, short, 16, 16)
    _feed(model, long, 16384, 1024)
    assert long.lengths.tolist() == [16384]
    assert long.nbytes() == short.nbytes()
    assert long.nbytes_in_use() == short.nbytes_in_use() == model.state_bytes_per_sequence(16384)
    assert model.state_bytes_per_sequence(16) == model.state_bytes_per_sequence(16384)
    assert pointers == [t.data_ptr() for layer in long.layers for t in layer.tensors()]  # updated in place


@pytest.mark.parametrize("kind", GROWING_STATE_KINDS)
def test_cache_bytes_in_use_grow_with_length_in_a_preallocated_cache(kind):
    model = make_tiny_model(kind)
    state = model.new_state(1)
    allocated = state.nbytes()
    pointers = [t.data_ptr() for layer in state.layers for t in layer.tensors()]
    in_use = []
    for _ in range(3):
        _feed(model, state, 16, 16)
        in_use.append(state.nbytes_in_use())
    assert in_use[0] < in_use[1] < in_use[2] <= allocated
    assert in_use[2] - in_use[1] == in_use[1] - in_use[0]  # the same bytes for every 16 tokens
    assert state.nbytes() == allocated  # preallocated for max_len, never regrown
    assert pointers == [t.data_ptr() for layer in state.layers for t in layer.tensors()]
    assert model.state_bytes_per_sequence(16) < model.state_bytes_per_sequence(32) < model.state_bytes_per_sequence()


def test_softmax_cache_holds_keys_and_values_for_each_token():
    model = make_tiny_model("softmax")
    state = model.new_state(2)
    _feed(model, state, 10, 10)
    cfg = model.config
    per_token = cfg.n_layers * 2 * cfg.d_model * 4  # K and V, float32
    assert state.nbytes_in_use() == 2 * 10 * per_token


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_in_use_of_the_first_rows_count_only_those_rows(kind):
    """The engine's gauge: live rows [0, n) of a compacted batch, without slicing the state."""
    model = make_tiny_model(kind)
    state = model.new_state(4)
    _feed(model, state, 10, 10)
    whole = state.nbytes_in_use()
    first_two = state.nbytes_in_use(2)
    assert 0 < first_two < whole
    assert first_two == state.slice(0, 2).nbytes_in_use()
    if kind in CONSTANT_STATE_KINDS:  # constant size: exactly two sequences' worth
        assert first_two == 2 * model.state_bytes_per_sequence()
