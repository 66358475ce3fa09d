"""A hybrid model's whole decode step as one C++ call (model/decode/compiled/hybrid_step.py,
model/kernels/hybrid_step.cpp) against the eager model: every feature map the attention kernel takes, grouped-query
heads, windows the rows cross, a head that runs after the call; the models it does not take, named with why; bad
inputs refused before anything is written; the compiled decoder running it."""

from __future__ import annotations

import copy

import pytest
import torch

from model.decode.compiled.decoder import CompiledDecoder
from model.decode.compiled.hybrid_step import hybrid_step_refusal, whole_hybrid_step
from model.decode.compiled.one_call import one_call_step
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.kernels.loader import packed_linear_wins, turn_off_cpu_kernels, use_cpu_kernels
from model.kernels.packed_linear import make_twin

from conftest import make_tiny_model, random_bytes
from kernel_support import assert_states_close, loaded_kernels, needs_compiler, run_both  # noqa: F401  (the fixture)

TOLERANCE = 1e-4
pytestmark = [needs_compiler, pytest.mark.usefixtures("kernels")]


def taken_model(kind: str = "hybrid", **overrides):
    """A tiny hybrid model with its kernels on, heads of 32 numbers and learned maps of 16 outputs (whole vectors on
    every route), a short window and random mixes (not their zero start, which weighs both parts alike)."""
    overrides = {"d_model": 64, "n_heads": 2, "hybrid_window": 5, "hybrid_features": 16, **overrides}
    model = make_tiny_model(kind, **overrides)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.mix.normal_(0.0, 1.0)
    use_cpu_kernels(model)
    return model


def taken_step(model):
    """The model's one-call step (its twin's, which keeps its layers' kernel); the model itself then steps on
    PyTorch's operators, the reference."""
    step = whole_hybrid_step(make_twin(model))
    assert step is not None, hybrid_step_refusal(make_twin(model))
    turn_off_cpu_kernels(model)
    return step


def random_states(model, starts: list[int]):
    """Two equal states of rows part-way through their sequences: any ring, sums of nonnegative features."""
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        states = model.new_state(len(starts)), model.new_state(len(starts))
        for layer in range(len(states[0].layers)):
            values = {name: torch.randn(getattr(states[0].layers[layer], name).shape, generator=gen) for name in "kvs"}
            values["z"] = torch.rand(states[0].layers[layer].z.shape, generator=gen) * 5 + 0.1
            for state in states:
                for name, value in values.items():
                    getattr(state.layers[layer], name).copy_(value)
        for state in states:
            state.lengths.copy_(torch.tensor(starts))
    return states


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("hybrid", {}),  # elu + 1
        ("hybrid+t2r", {"hybrid_features": 16}),
        ("hybrid+hedgehog", {"hybrid_features": 16}),
        ("hybrid+hedgehog", {"hybrid_features": 16, "n_heads": 4, "d_model": 128, "kv_heads": 2}),  # grouped
        ("hybrid", {"kv_heads": 1, "hybrid_window": 64}),  # one key head for both; the shipped window
        ("hybrid", {"task": "mnist", "output_head": "logistic_mixture"}),  # a head that runs after the call
        ("hybrid", {"hybrid_eps": 0.5, "ln_eps": 0.1}),  # epsilons that show in the logits, each in its place
    ],
    ids=["elu", "t2r", "hedgehog", "hedgehog-grouped", "elu-one-key-head-w64", "mixture-head", "epsilons"],
)
def test_the_one_call_step_equals_the_eager_model(kind, overrides):
    # Rows at the start, inside the window, at its edge and well past it; twelve steps move all across an edge.
    model = taken_model(kind, **overrides)
    eager, one_call = random_states(model, starts=[0, 3, 4, 5, 40, 70])
    assert run_both(model, taken_step(model), eager, one_call, steps=12) < TOLERANCE
    assert_states_close(one_call, eager, ["k", "v", "s", "z"])


def test_a_single_row_steps_as_a_batch_row_does():
    model = taken_model()
    assert run_both(model, taken_step(model), *random_states(model, starts=[2]), steps=8) < TOLERANCE


@pytest.mark.parametrize(
    "kind, overrides, named",
    [
        ("softmax", {}, "softmax attention (it takes hybrid attention)"),
        ("hybrid+llama", {}, "rotary positions"),
        ("hybrid", {"gelu": "tanh"}, "tanh GELU"),
        ("hybrid", {"d_model": 68, "n_heads": 4}, "heads of 17 numbers"),  # no vector route takes them
    ],
)
def test_models_it_does_not_take_are_named_with_why(kernels, kind, overrides, named):
    if kernels.route == "scalar" and "17" in named:
        pytest.skip("the scalar build has one lane, so it takes every head size")
    twin = make_twin(make_tiny_model(kind, **{"d_model": 64, **overrides}))
    assert named in hybrid_step_refusal(twin) and one_call_step(twin) is None


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda tokens, state: tokens.fill_(300), "outside the vocabulary"),
        (lambda tokens, state: state.lengths.fill_(10_000), "past the model's"),
        (lambda tokens, state: setattr(state.layers[-1], "z", state.layers[-1].z[:, :, :3]), "z must be a contiguous"),
        (lambda tokens, state: setattr(state, "lengths", state.lengths.int()), "int64"),
    ],
    ids=["token", "position", "state", "lengths"],
)
def test_bad_inputs_are_refused_with_what_is_wrong(change, message):
    model = taken_model()
    step = whole_hybrid_step(make_twin(model))
    with torch.inference_mode():
        state, tokens = model.new_state(3), torch.zeros(3, dtype=torch.long)
        change(tokens, state)
        layers = [getattr(layer, name) for layer in state.layers for name in "kvsz"]
        before = [t.clone() for t in layers] + [state.lengths.clone()]
        with pytest.raises(RuntimeError, match=message):
            step(tokens, state)
        after = layers + [state.lengths]
        assert all(torch.equal(b, a) for b, a in zip(before, after))  # refused before anything was written


# Decoders take the one call only where their linear layers are packed (model/kernels/packed_linear.py, `packs`).
packed_decoders = pytest.mark.skipif(
    not packed_linear_wins(), reason="this CPU's route keeps PyTorch's linear layers: its decoders make no twin"
)


@packed_decoders
def test_the_compiled_decoder_runs_it_and_generates_the_eager_tokens():
    """From the moment the kernels load: its steps are the one call, its unfiltered draws in C++ after it, and a
    generation across the window's edge is the eager decoder's, rows leaving as in a server's batch."""
    model, rows = taken_model("hybrid+hedgehog", hybrid_features=16), 4
    with torch.inference_mode():
        decoder = CompiledDecoder(model, model.new_state(rows))
        decoder.use_kernels()
        assert decoder.one_call_steps
        assert decoder.describe_route().endswith(": one-call steps on the packed kernel, draws in C++ (compiling)")
        reference = copy.deepcopy(model)
        turn_off_cpu_kernels(reference)  # PyTorch's step
        eager = EagerDecoder(reference, reference.new_state(rows))
        tokens = random_bytes(3, rows, 1)[:, 0]
        for n in (rows,) * 8 + (2, 1):
            want, got = eager(tokens[:n]), decoder(tokens[:n])
            assert float((want - got).abs().max()) < TOLERANCE
            tokens = want.argmax(-1)
        sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=s) for s in range(rows)])
        prompt = random_bytes(4, rows, 3)
        want_tokens = generate(
            reference, prompt, 12, sampling, decoder=EagerDecoder(reference, reference.new_state(rows))
        )
        decoder = CompiledDecoder(model, model.new_state(rows))
        decoder.use_kernels()
        assert torch.equal(generate(model, prompt, 12, sampling, decoder=decoder), want_tokens)
