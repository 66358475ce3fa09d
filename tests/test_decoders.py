"""Decode steps at padded batch sizes (any device) and as CUDA graphs (CUDA only).

The engine keeps live sequences in rows [0, n) and runs one decode step over
them; a padded decoder runs the smallest padded size >= n instead, so rows
[n, size) are free slots it may scribble on. These tests drive both decoders
through the engine's pattern (rows finish, new ones join after a reset) and
check that the live rows' logits never depend on the padding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model.decode.eager_and_cuda_graphs import CudaGraphDecoder, EagerDecoder, PaddedDecoder, padded_sizes
from model.decode.choice import make_decoder
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.transformer import SequenceTooLong

from conftest import GRAPHABLE_KINDS, KINDS, PADDABLE_KINDS, make_tiny_model, random_bytes, shared_tiny_model

NO_CUDA = not torch.cuda.is_available()
cuda_only = pytest.mark.skipif(
    NO_CUDA, reason="CUDA is not available on this machine (torch.cuda.is_available() is False)"
)
ROWS = 8


@pytest.mark.parametrize(
    "max_batch, sizes", [(1, [1]), (2, [1, 2]), (48, [1, 2, 4, 8, 16, 32, 48]), (64, [1, 2, 4, 8, 16, 32, 64])]
)
def test_padded_sizes_are_powers_of_two_then_the_slot_count(max_batch, sizes):
    assert padded_sizes(max_batch) == sizes


def test_padded_decoder_refuses_more_rows_than_its_largest_size():
    model = make_tiny_model("linear")
    decoder = PaddedDecoder(model, model.new_state(ROWS), [1, 4])
    assert decoder.size_for(3) == 4
    with pytest.raises(ValueError, match="more than the largest padded size 4"):
        decoder(torch.zeros(5, dtype=torch.long))


def _engine_schedule(decoder_a, decoder_b, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Drive two decoders over copies of one state through shrinking and growing batches:
    (logits a, logits b) of the live rows at every step."""
    tokens = random_bytes(seed, ROWS, 40)
    pairs = []
    # live rows per step: all, then rows finish (5, 3), then one joins (4) from a reset row
    for step, live in enumerate([8, 8, 5, 5, 3, 4, 4, 2]):
        if live > (pairs[-1][0].shape[0] if pairs else ROWS):
            for decoder in (decoder_a, decoder_b):
                decoder.state.reset_rows([live - 1])
        pairs.append((decoder_a(tokens[:live, step]).float().clone(), decoder_b(tokens[:live, step]).float().clone()))
    return pairs


@pytest.mark.parametrize("kind", PADDABLE_KINDS)
@torch.inference_mode()
def test_padded_steps_give_the_live_rows_the_same_logits_as_exact_steps(kind):
    model = make_tiny_model(kind)
    eager = EagerDecoder(model, model.new_state(ROWS))
    padded = PaddedDecoder(model, model.new_state(ROWS), [1, 2, 8])  # 3 and 5 live rows pad to 8
    for got_eager, got_padded in _engine_schedule(eager, padded, seed=3):
        torch.testing.assert_close(got_padded, got_eager, atol=1e-5, rtol=0)


def test_reformer_steps_are_never_padded():
    # Its padding rows would restart at position 0 every step while their bucket lists kept growing.
    model = make_tiny_model("reformer")
    with pytest.raises(ValueError, match="reformer decode steps cannot be padded"):
        PaddedDecoder(model, model.new_state(2), [2])


def test_generate_refuses_to_run_past_max_len():
    model = make_tiny_model("linear", max_len=16, pos_encoding="sinusoidal")  # nothing else would stop it
    sampling = BatchSampling.from_params([SamplingParams(seed=0)], model.device)
    with pytest.raises(SequenceTooLong, match="cannot generate 17 tokens; this model's max_len is 16"):
        generate(model, random_bytes(0, 1, 4), 17, sampling)


@torch.inference_mode()
def test_a_reused_decoder_generates_what_a_fresh_state_generates():
    model = shared_tiny_model("linear")
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(3)], model.device)
    prompt = random_bytes(5, 3, 4)
    fresh = generate(model, prompt, 30, sampling)
    decoder = PaddedDecoder(model, model.new_state(3), [3])
    first = generate(model, prompt, 30, sampling, decoder=decoder)
    again = generate(model, prompt, 30, sampling, decoder=decoder)  # the state is reset each time
    assert torch.equal(first, fresh) and torch.equal(again, fresh)


def test_make_decoder_stays_eager_off_cuda_or_for_variable_length_kinds():
    for kind in ("linear", "softmax"):
        model = make_tiny_model(kind)
        decoder = make_decoder(model, model.new_state(2), cuda_graphs=True)
        assert type(decoder) is EagerDecoder and not decoder.graphed


# ---------------------------------------------------------------- CUDA graphs


@cuda_only
@pytest.mark.parametrize("kind", GRAPHABLE_KINDS)
@torch.inference_mode()
def test_cuda_graph_steps_match_eager_steps_on_the_gpu(kind):
    model = copy.deepcopy(make_tiny_model(kind)).cuda()
    eager = EagerDecoder(model, model.new_state(ROWS))
    graphed = make_decoder(model, model.new_state(ROWS), cuda_graphs=True, sizes=[1, 2, 4, 8])
    assert isinstance(graphed, CudaGraphDecoder) and graphed.graphed
    assert int(graphed.state.lengths.abs().sum()) == 0  # capture left the state as it found it
    for got_eager, got_graphed in _engine_schedule(eager, graphed, seed=4):
        torch.testing.assert_close(got_graphed, got_eager, atol=1e-4, rtol=0)


@cuda_only
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in GRAPHABLE_KINDS])
def test_variable_length_kinds_run_eagerly_on_the_gpu(kind):
    model = copy.deepcopy(make_tiny_model(kind)).cuda()
    assert not make_decoder(model, model.new_state(2), cuda_graphs=True).graphed


def test_cuda_graph_decoder_refuses_a_cpu_model():
    model = make_tiny_model("linear")
    with pytest.raises(ValueError, match="need a CUDA model"):
        CudaGraphDecoder(model, model.new_state(2), [2])
