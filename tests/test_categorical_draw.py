"""The draw in C++ (model/kernels/categorical_draw.cpp): alone, and inside a linear model's one-call step, against
model/decode/sampling.py's eager draw token for token, its distribution against softmax, and generations of a
decoder that draws inside its steps against the eager decoder's."""

from __future__ import annotations

import pytest
import torch

from model.decode.compiled.decoder import CompiledDecoder
from model.decode.compiled.linear_step import whole_linear_step
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams, sample
from model.kernels.loader import packed_linear_wins
from model.kernels.packed_linear import make_twin

from conftest import make_tiny_model, random_bytes
from kernel_support import loaded_kernels  # noqa: F401  (the `kernels` fixture)
from kernel_support import needs_compiler
from test_sampling import chi_square, chi_square_bound

pytestmark = [needs_compiler, pytest.mark.usefixtures("kernels")]
# Temperatures 0 (greedy), below the clamp, and either side of 1.
TEMPERATURES = [0.0, 1e-6, 0.3, 0.7, 1.0, 1.5, 3.0]


def unfiltered(temperatures: list[float], seeds: list[int]) -> BatchSampling:
    params = [SamplingParams(temperature=t, seed=s) for t, s in zip(temperatures, seeds)]
    batch = BatchSampling.from_params(params)
    assert batch.filters is False
    return batch


def kernel_draw(logits: torch.Tensor, params: BatchSampling, position: torch.Tensor) -> torch.Tensor:
    drawn = torch.full((logits.shape[0],), -1, dtype=torch.long)
    torch.ops.rnnserve.categorical_draw(logits, params.temperature, params.seed, position, drawn)
    return drawn


def mixed_rows(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, BatchSampling]:
    """Logits with some tokens at -inf, every temperature, seeds of 64 bits and negative ones."""
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(rows, vocab, generator=gen)
    logits[torch.rand(rows, vocab, generator=gen) < 0.1] = float("-inf")
    logits[:, 0] = 0.0  # a finite logit in every row
    temperatures = [TEMPERATURES[r % len(TEMPERATURES)] for r in range(rows)]
    seeds = [r if r % 3 else (-1) ** r * (2**40 + 977 * r) for r in range(rows)]
    return logits, unfiltered(temperatures, seeds)


@pytest.mark.parametrize("vocab", [1, 7, 16, 259, 1000])
def test_the_kernel_draws_the_eager_tokens(vocab):
    """Every temperature, seeds of all 64 bits, positions past 2^32; vocabularies that end in part of a vector."""
    logits, params = mixed_rows(64, vocab, seed=vocab)
    for position in [*range(40), 2**32 + 5, 2**40 + 3]:
        where = torch.full((64,), position)
        assert torch.equal(kernel_draw(logits, params, where), sample(logits, params, where)), f"position {position}"


def test_strided_logits_and_a_column_of_drawn_tokens():
    """A prefill's last position (rows apart by more than V) and a generation's column of tokens (stride T)."""
    chunk = torch.randn(8, 5, 259, generator=torch.Generator().manual_seed(2)) * 3
    params = unfiltered([0.0, 0.5, 1.0, 2.0] * 2, list(range(8)))
    tokens = torch.full((8, 6), -1, dtype=torch.long)
    where = torch.arange(8) * 11
    torch.ops.rnnserve.categorical_draw(chunk[:, -1], params.temperature, params.seed, where, tokens[:, 2])
    assert torch.equal(tokens[:, 2], sample(chunk[:, -1].contiguous(), params, where))
    assert bool((tokens[:, [0, 1, 3, 4, 5]] == -1).all()), "wrote outside its column"


def test_greedy_rows_take_the_first_largest_logit_whatever_their_seed():
    logits = torch.randint(0, 4, (32, 259), generator=torch.Generator().manual_seed(3)).float()  # ties everywhere
    for seed in (0, 1, 2**50):
        drawn = kernel_draw(logits, unfiltered([0.0] * 32, [seed] * 32), torch.arange(32))
        assert torch.equal(drawn, logits.argmax(-1))


def test_the_same_seed_draws_the_same_tokens_twice_and_alone_as_in_a_batch():
    logits, params = mixed_rows(16, 259, seed=4)
    where = torch.full((16,), 9)
    first = kernel_draw(logits, params, where)
    assert torch.equal(kernel_draw(logits, params, where), first)
    for row in (0, 5, 15):
        alone = BatchSampling(
            params.temperature[row : row + 1], params.top_k[:1], params.top_p[:1], params.seed[row : row + 1], False
        )
        assert int(kernel_draw(logits[row : row + 1], alone, where[:1])) == int(first[row])
    sampled = params.temperature > 0
    reseeded = BatchSampling(params.temperature, params.top_k, params.top_p, params.seed + 1, False)
    assert not torch.equal(kernel_draw(logits, reseeded, where)[sampled], first[sampled])


@pytest.mark.parametrize("by", ["seed", "position"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_kernel_draw_frequencies_match_softmax(temperature, by):
    """20,000 draws of one distribution (tokens at -inf among them, never drawn), by seed (many requests) or by
    position (one long request): Pearson's statistic within the bound test_sampling.py holds the eager draw to."""
    logits = 1.5 * torch.randn(1, 12, generator=torch.Generator().manual_seed(3))
    logits[0, [2, 7]] = float("-inf")
    n, index = 20_000, torch.arange(20_000)
    seeds = index + 10 if by == "seed" else torch.full((n,), 10)
    positions = torch.full((n,), 3) if by == "seed" else index
    params = BatchSampling(torch.full((n,), temperature), torch.zeros(n), torch.ones(n), seeds, False)
    drawn = kernel_draw(logits.expand(n, -1), params, positions)
    chi2, dof = chi_square(drawn, torch.softmax(logits[0] / temperature, -1))
    assert chi2 < chi_square_bound(dof)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"logits": lambda t: t.double()}, "float32"),
        ({"logits": lambda t: t[:, ::2]}, "unit stride"),
        ({"seed": lambda t: t.int()}, "int64 seeds"),
        ({"temperature": lambda t: t[:3]}, "per row of the 4 rows"),
        ({"drawn": lambda t: t.float()}, "int64"),
    ],
    ids=["float64-logits", "strided-vocabulary", "int32-seeds", "too-few-temperatures", "float-out"],
)
def test_bad_inputs_are_refused_with_what_is_wrong(change, message):
    inputs = {
        "logits": torch.randn(4, 20),
        "temperature": torch.ones(4),
        "seed": torch.zeros(4, dtype=torch.long),
        "position": torch.zeros(4, dtype=torch.long),
        "drawn": torch.zeros(4, dtype=torch.long),
    }
    for name, how in change.items():
        inputs[name] = how(inputs[name])
    with pytest.raises(RuntimeError, match=message):
        torch.ops.rnnserve.categorical_draw(*inputs.values())


def taken_model(**overrides):
    """A tiny linear model the one-call step takes (heads of 16 numbers: whole vectors on every route)."""
    return make_tiny_model("linear", **{"d_model": 64, "n_heads": 4, **overrides})


def test_the_step_with_its_draw_is_the_step_then_the_draw():
    """Bit for bit: the same logits, the same state after it, and the tokens the draw alone takes from them."""
    model, rows = taken_model(), 6
    step = whole_linear_step(make_twin(model))
    assert step is not None and step.head_inside
    params = unfiltered(TEMPERATURES[:rows], [11, 12, 13, 14, 15, 2**45])
    with torch.inference_mode():
        apart, together = model.new_state(rows), model.new_state(rows)
        tokens = random_bytes(5, rows, 1)[:, 0]
        for position in range(8):
            where = torch.full((rows,), position)
            logits = step(tokens, apart)
            want = kernel_draw(logits, params, where)
            drawn = torch.empty(rows, dtype=torch.long)
            got = step.with_draw(tokens, together, (params.temperature, params.seed, where), drawn)
            assert torch.equal(got, logits) and torch.equal(drawn, want)
            tokens = want
        assert torch.equal(apart.lengths, together.lengths)
        assert all(torch.equal(a.sz_t, b.sz_t) for a, b in zip(apart.layers, together.layers))


def test_a_step_whose_draw_inputs_are_wrong_is_refused_before_it_moves_the_state():
    model, rows = taken_model(), 3
    step = whole_linear_step(make_twin(model))
    assert step is not None
    with torch.inference_mode():
        state = model.new_state(rows)
        before = [state.lengths.clone(), *(layer.sz_t.clone() for layer in state.layers)]
        rows_of_two = (torch.ones(2), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
        with pytest.raises(RuntimeError, match="per row of the 3 rows"):
            step.with_draw(torch.zeros(rows, dtype=torch.long), state, rows_of_two, torch.zeros(2, dtype=torch.long))
        after = [state.lengths, *(layer.sz_t for layer in state.layers)]
        assert all(torch.equal(b, a) for b, a in zip(before, after))


packed_decoders = pytest.mark.skipif(
    not packed_linear_wins(), reason="this CPU's route keeps PyTorch's linear layers: its decoders make no twin"
)


@packed_decoders
@pytest.mark.parametrize("rows", [5, 1])
def test_a_one_call_decoder_generates_the_eager_tokens(rows):
    """Unfiltered batches draw inside the step (greedy rows among them), filtered ones eagerly, known tokens are kept:
    the eager decoder's generation token for token, from the moment the kernels load (nothing compiled)."""
    model = taken_model()
    with torch.inference_mode():
        decoder = CompiledDecoder(model, model.new_state(rows))
        decoder.use_kernels()
    assert decoder.one_call_steps and decoder.describe_route().endswith(
        "one-call steps on the packed kernel, draws in C++ (compiling)"
    )
    prompts = random_bytes(6, rows, 4)
    forced = torch.full((rows, 30), -1, dtype=torch.long)
    forced[:, 10:12] = 7
    temperatures = [TEMPERATURES[(r + 2) % len(TEMPERATURES)] for r in range(rows)]
    for params in (
        [SamplingParams(temperature=t, seed=r) for r, t in enumerate(temperatures)],
        [SamplingParams(temperature=t, seed=r, top_k=5) for r, t in enumerate(temperatures)],
    ):
        sampling = BatchSampling.from_params(params)
        eager = EagerDecoder(model, model.new_state(rows))
        for known in (None, forced):
            want = generate(model, prompts, 30, sampling, forced=known, decoder=eager)
            assert torch.equal(generate(model, prompts, 30, sampling, forced=known, decoder=decoder), want)
