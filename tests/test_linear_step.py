"""A linear model's whole decode step as one C++ call (model/decode/compiled/linear_step.py,
model/kernels/linear_step.cpp) against the eager model, on this CPU's route (tests/test_cpu_kernels.py runs it on the
other routes, forced)."""

from __future__ import annotations

import logging

import pytest
import torch

from model.decode.compiled.decoder import CompiledDecoder
from model.kernels.loader import load_kernels, packed_linear_wins
from model.decode.generate import generate
from model.decode.compiled.linear_step import whole_linear_step, whole_step_refusal
from model.kernels.packed_linear import make_twin
from model.decode.sampling import BatchSampling, SamplingParams
from model.decode.eager_and_cuda_graphs import EagerDecoder

from conftest import make_tiny_model, random_bytes
from kernel_support import loaded_kernels  # noqa: F401  (the `kernels` fixture)
from kernel_support import assert_states_close, needs_compiler, run_both

TOLERANCE = 1e-4
pytestmark = [needs_compiler, pytest.mark.usefixtures("kernels")]


def taken_model(**overrides):
    """A tiny linear model whose heads (16 numbers by default) are whole vectors on every route."""
    return make_tiny_model("linear", **{"d_model": 64, "n_heads": 4, **overrides})


def taken_step(model):
    """The model's one-call step (its twin's)."""
    step = whole_linear_step(make_twin(model))
    assert step is not None, whole_step_refusal(make_twin(model))
    return step


def partway_states(model, starts: list[int]):
    """Two equal states of rows part-way through their sequences (at positions `starts`), with sums in their states."""
    with torch.inference_mode():
        states = model.new_state(len(starts)), model.new_state(len(starts))
        for state in states:
            state.lengths.copy_(torch.tensor(starts))
            for layer in state.layers:
                layer.sz_t.copy_(torch.rand(layer.sz_t.shape, generator=torch.Generator().manual_seed(1)))
    return states


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # heads of 16 numbers, a 64-wide feed-forward
        {"n_heads": 2, "d_ff": 72},  # heads of 32; a feed-forward that ends in part of a vector
        {"d_model": 96, "n_heads": 2, "n_layers": 3},  # heads of 48: three vectors of 16, six of 8
        {"task": "mnist", "output_head": "logistic_mixture"},  # a head that runs after the call
        {"linear_eps": 0.5, "ln_eps": 0.1},  # epsilons that show in the logits, each in its place
    ],
    ids=["d16", "d32-ff72", "d48", "mixture-head", "epsilons"],
)
def test_the_one_call_step_equals_the_eager_model(overrides):
    model = taken_model(**overrides)
    eager, one_call = partway_states(model, starts=[0, 5, 17, 40, 3])
    assert run_both(model, taken_step(model), eager, one_call, steps=6) < TOLERANCE
    assert_states_close(one_call, eager, ["sz_t"])


def test_a_single_row_steps_as_a_batch_row_does():
    model = taken_model()
    assert run_both(model, taken_step(model), *partway_states(model, starts=[9]), steps=4) < TOLERANCE


@pytest.mark.parametrize(
    "kind, overrides, named",
    [
        ("softmax", {}, "softmax attention"),
        ("linear+hedgehog", {}, "hedgehog features"),
        ("linear", {"pos_encoding": "sinusoidal"}, "sinusoidal positions"),
        ("linear", {"gelu": "tanh"}, "tanh GELU"),
        ("linear", {"kv_heads": 2}, "kv_heads 2"),
        ("linear+llama", {}, "rotary positions"),
    ],
)
def test_models_it_does_not_take_are_named_with_why(kind, overrides, named):
    twin = make_twin(make_tiny_model(kind, **{"d_model": 64, **overrides}))
    assert named in whole_step_refusal(twin) and whole_linear_step(twin) is None


def test_heads_that_are_not_whole_vectors_are_left_to_the_compiled_step():
    twin = make_twin(taken_model(d_model=68))  # heads of 17 numbers: a whole number of vectors only without any
    taken = torch.ops.rnnserve.linear_step_takes_head(17)
    assert taken == (load_kernels().route == "scalar")
    assert (whole_step_refusal(twin) is None) == taken


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda tokens, state: tokens.fill_(300), "outside the vocabulary"),
        (lambda tokens, state: state.lengths.fill_(10_000), "past the model's"),
        (lambda tokens, state: setattr(state.layers[-1], "sz_t", state.layers[-1].sz_t[:, :2]), "(B, H, D + 1, D)"),
        (lambda tokens, state: setattr(state, "lengths", state.lengths.int()), "int64"),
    ],
    ids=["token", "position", "state", "lengths"],
)
def test_bad_inputs_are_refused_with_what_is_wrong(change, message):
    model = taken_model()
    step = whole_linear_step(make_twin(model))
    with torch.inference_mode():
        state, tokens = model.new_state(3), torch.zeros(3, dtype=torch.long)
        change(tokens, state)
        before = [layer.sz_t.clone() for layer in state.layers] + [state.lengths.clone()]
        with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
            step(tokens, state)
        after = [layer.sz_t for layer in state.layers] + [state.lengths]
        assert all(torch.equal(b, a) for b, a in zip(before, after))  # refused before anything was written


# Decoders take the one call only where their linear layers are packed (model/kernels/packed_linear.py, `packs`).
packed_decoders = pytest.mark.skipif(
    not packed_linear_wins(), reason="this CPU's route keeps PyTorch's linear layers: its decoders make no twin"
)


@packed_decoders
def test_the_compiled_decoder_runs_it_as_soon_as_the_kernels_load():
    """Before any graph is compiled: its steps are the one call, and generate what the eager decoder does."""
    model, rows = taken_model(), 4
    with torch.inference_mode():
        eager = EagerDecoder(model, model.new_state(rows))
        decoder = CompiledDecoder(model, model.new_state(rows))
        decoder.use_kernels()
        assert decoder.describe_route().endswith(": one-call steps on the packed kernel, draws in C++ (compiling)")
        tokens = random_bytes(3, rows, 1)[:, 0]
        for n in (rows, rows, 2, 1):  # rows leave as in a server's batch: the first n stay
            want, got = eager(tokens[:n]), decoder(tokens[:n])
            assert float((want - got).abs().max()) < TOLERANCE
            tokens = want.argmax(-1)
        assert torch.equal(eager.state.lengths, decoder.state.lengths)


@packed_decoders
def test_a_batch_that_shrinks_and_grows_again_steps_its_rows_where_they_were_left():
    """The decoder makes the one call on each row count's views once and keeps it: rows left out for a while, then
    stepped again, go on from the state the other row counts' calls left them in, as the eager decoder's do."""
    model, rows = taken_model(), 4
    with torch.inference_mode():
        eager = EagerDecoder(model, model.new_state(rows))
        decoder = CompiledDecoder(model, model.new_state(rows))
        decoder.use_kernels()
        assert decoder.one_call_steps
        for seed, n in enumerate((rows, 2, rows, 1, 2, rows)):
            tokens = random_bytes(seed, n, 1)[:, 0]
            assert float((eager(tokens) - decoder(tokens)).abs().max()) < TOLERANCE
        assert_states_close(decoder.state, eager.state, ["sz_t"])


@packed_decoders
def test_a_step_taken_anew_does_not_step_with_the_last_ones_row_views():
    """The decoder keeps the one call on each row count's views, for that step: a step taken since (another twin's
    weights) steps those rows with its own weights, not the kept call's."""
    model, other, rows = taken_model(), taken_model(seed=1), 3
    tokens = random_bytes(3, rows, 1)[:, 0]
    with torch.inference_mode():
        decoder = CompiledDecoder(model, model.new_state(rows))
        decoder.use_kernels()
        assert decoder.one_call_steps
        decoder(tokens)  # the call on these rows' views, kept
        decoder.state.reset_rows(range(rows))
        decoder._whole_step = taken_step(other)
        want = other.decode_step(tokens, other.new_state(rows))
        assert float((decoder(tokens) - want).abs().max()) < TOLERANCE


@packed_decoders
def test_a_decoder_kept_on_its_graphs_does_not_take_the_one_call_step():
    """What benchmarks/step_bounds.py compares the one call with: the same model's compiled graph steps."""
    model = taken_model()
    with torch.inference_mode():
        kept = CompiledDecoder(model, model.new_state(2), one_call=False)
        kept.use_kernels()
        taken = CompiledDecoder(model, model.new_state(2))
        taken.use_kernels()
    assert taken.one_call_steps and not kept.one_call_steps
    assert "one-call" not in kept.describe_route()


@packed_decoders
def test_a_one_call_decoder_compiles_only_its_draws(caplog):
    """Its steps never run a graph, so none is traced for them; its draws are compiled, guard-free (for batches the
    C++ draw does not take as they are), and the generation is the eager one's."""
    model, rows = taken_model(), 4
    with torch.inference_mode():
        decoder = CompiledDecoder(model, model.new_state(rows))
        with caplog.at_level(logging.INFO, logger="rnnserve.compiled_decode"):
            log = decoder.compile_now(batch=rows)
        assert log.error is None and decoder.compiled and decoder.one_call_steps, log
        assert decoder.captured(rows), "its draws would keep their guard checks"
        steps = decoder.graphs.steps.values()
        assert not any(g.traced() for g in steps), "a step graph was compiled, which its steps never run"
        assert any(g.traced() for g in decoder.graphs.draws.values()), "its draws were not compiled"
        compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled the linear")]
        assert compiled and all("sampling (its steps are one C++ call)" in line for line in compiled), compiled
        sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=s) for s in range(rows)])
        prompt = torch.zeros(rows, 0, dtype=torch.long)
        want = generate(model, prompt, 12, sampling, decoder=EagerDecoder(model, model.new_state(rows)))
        assert torch.equal(generate(model, prompt, 12, sampling, decoder=decoder), want)
