"""Sampling: exact draws, filters, and per-request reproducibility.

A request's tokens depend only on its logits, parameters, seed and position,
never on the other rows of its batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.decode.generate import generate
from model.decode.sampling import (
    BatchSampling,
    SamplingParams,
    _times,
    POINT_BITS,
    force_tokens,
    fraction_of,
    inverse_cdf,
    row_keys,
    row_points,
    sample,
    token_logprobs,
    top_k_mask,
    top_p_mask,
)
from model.transformer import with_bos

from conftest import random_bytes, shared_tiny_model

VOCAB = 256


def random_logits(seed: int, batch: int, vocab: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(batch, vocab, generator=gen)


def batch_of(params: list[SamplingParams]) -> BatchSampling:
    return BatchSampling.from_params(params)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, by: str = "seed") -> torch.Tensor:
    """n draws from one (V,) distribution, varying the seed (many requests) or the
    position (one request over a long sequence)."""
    index = torch.arange(n)
    seeds = index + params.seed if by == "seed" else torch.full((n,), params.seed)
    positions = torch.full((n,), 3) if by == "seed" else index
    batch = BatchSampling(
        torch.full((n,), params.temperature), torch.full((n,), params.top_k), torch.full((n,), params.top_p), seeds
    )
    return sample(logits_row.expand(n, -1), batch, positions)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of observed token counts against probs; returns (chi2, degrees of freedom)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token of probability zero"
    chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    return chi2, int(support.sum()) - 1


def chi_square_bound(dof: int) -> float:
    # Mean dof, sd sqrt(2 dof): 6 sd is far beyond chance (draws are deterministic
    # anyway), and far below what a biased sampler produces with 20,000 draws.
    return dof + 6 * math.sqrt(2 * dof)


# ---------------------------------------------------------------- reproducibility

MIXED_PARAMS = [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=20, seed=2),
    SamplingParams(temperature=1.3, top_p=0.9, seed=3),
    SamplingParams(temperature=0.0, seed=4),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.5, seed=2**40 + 5),
]


def test_a_row_draws_the_same_tokens_alone_or_in_a_batch():
    batch = batch_of(MIXED_PARAMS)
    for step in range(40):
        logits = random_logits(step, len(MIXED_PARAMS))
        position = torch.tensor([step, step + 7, 0, step, 700 + step])
        together = sample(logits, batch, position)
        for row, params in enumerate(MIXED_PARAMS):
            alone = sample(logits[row : row + 1], batch_of([params]), position[row : row + 1])
            assert int(alone) == int(together[row])
        reordered = sample(logits.flip(0), batch_of(MIXED_PARAMS[::-1]), position.flip(0))
        assert torch.equal(reordered.flip(0), together)


def test_different_seeds_draw_different_tokens():
    logits = torch.zeros(64, VOCAB)  # uniform: the tokens follow the uniforms themselves
    positions = torch.arange(64)
    first = sample(logits, batch_of([SamplingParams(seed=1)] * 64), positions)
    second = sample(logits, batch_of([SamplingParams(seed=2)] * 64), positions)
    assert (first != second).float().mean() > 0.9
    assert len(set(first.tolist())) > 40  # and a seed does not repeat one token along positions


def test_a_row_s_point_is_a_pure_function_of_its_seed_and_position():
    seeds, positions = torch.tensor([5, 5, 9, 5]), torch.tensor([3, 3, 3, 4])
    points = row_points(seeds, positions)
    assert points[0] == points[1]
    assert points[0] != points[2] and points[0] != points[3]
    assert torch.equal(row_points(seeds[:1], positions[:1]), points[:1])


@pytest.mark.parametrize("constant", [0x7FEB352D, 0x846CA68B, 0x9E3779B9, (1 << 32) - 1])
def test_the_hash_multiplies_modulo_2_32_without_an_overflowing_product(constant):
    """What every backend computes alike: the product modulo 2^32, for 32-bit values up to the largest."""
    values = [0, 1, 2, 0xFFFF, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 2, (1 << 32) - 1, 0x9E3779B9]
    got = _times(torch.tensor(values), constant)
    assert got.tolist() == [v * constant % (1 << 32) for v in values]


def test_a_seed_s_positions_get_distinct_keys_and_seeds_beyond_62_bits_are_taken():
    positions = torch.arange(5000)
    keys = row_keys(torch.full_like(positions, 12345), positions)
    assert keys.unique().numel() == positions.numel()
    assert int(keys.min()) >= 0 and int(keys.max()) < 1 << 32
    extremes = torch.tensor([-(1 << 63), -1, 0, (1 << 63) - 1])  # any int64 a request may carry
    assert row_keys(extremes, torch.zeros_like(extremes)).unique().numel() == 4


def test_row_points_cover_their_23_bits_evenly():
    seeds = torch.arange(100_000)
    points = row_points(seeds, torch.zeros_like(seeds))
    assert points.min() >= 0 and points.max() < 1 << POINT_BITS
    counts = torch.histc(points.double(), bins=10, min=0, max=1 << POINT_BITS)
    assert counts.min() > 9_500 and counts.max() < 10_500  # 10,000 each, give or take 5 sigma


def test_a_fraction_of_a_total_is_floor_total_times_point_over_2_to_the_23_up_to_totals_of_2_to_the_62():
    """Exact where total * point itself would overflow int64: a target below the total for every point."""
    totals = [1 << 24, (1 << 24) + 1, 3 << 40, (1 << 50) - 1, (1 << 62) - 1]
    points = [0, 1, 12345, (1 << POINT_BITS) - 1]
    got = fraction_of(torch.tensor(totals)[:, None], torch.tensor(points)[None, :])
    assert got.tolist() == [[t * p >> POINT_BITS for p in points] for t in totals]
    assert (got < torch.tensor(totals)[:, None]).all()


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e4])
def test_inverse_cdf_takes_the_first_and_last_kept_tokens_at_the_extreme_points_never_a_dropped_one(scale):
    """Tokens 5 to 29 kept, the rest dropped by a filter (-inf); tokens 5 and 29 tie for the best. Point 0
    takes token 5 and the largest point token 29, whatever the spread of the logits between them."""
    logits = torch.full((1, 40), float("-inf"))
    logits[0, 5:30] = scale * torch.randn(25, generator=torch.Generator().manual_seed(0))
    logits[0, [5, 29]] = logits.amax()
    drawn = inverse_cdf(logits.expand(2, -1), torch.tensor([0, (1 << POINT_BITS) - 1]))
    assert drawn.tolist() == [5, 29]


# ---------------------------------------------------------------- greedy and filters


def test_temperature_zero_is_argmax_whatever_the_other_parameters():
    logits = random_logits(0, 200)
    params = [SamplingParams(temperature=0.0, top_k=i % 4, top_p=0.3 + (i % 7) / 10, seed=i) for i in range(200)]
    tokens = sample(logits, batch_of(params), torch.arange(200))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_1_is_argmax_for_every_seed():
    logits = random_logits(1, 1).expand(12_000, -1)
    seeds = torch.arange(12_000)
    batch = BatchSampling(torch.ones(12_000), torch.ones(12_000, dtype=torch.long), torch.ones(12_000), seeds)
    tokens = sample(logits, batch, torch.zeros_like(seeds))
    wrong = (tokens != logits.argmax(-1)).nonzero().flatten()
    assert wrong.numel() == 0, f"seeds {wrong.tolist()} drew tokens {tokens[wrong].tolist()} outside the top 1"


def test_top_k_keeps_exactly_the_k_best():
    logits = random_logits(2, 3, vocab=50)
    masked = top_k_mask(logits, torch.tensor([1, 7, 0]))
    kept = torch.isfinite(masked)
    assert kept.sum(-1).tolist() == [1, 7, 50]
    assert torch.equal(kept[1], logits[1] >= logits[1].topk(7).values[-1])
    assert torch.equal(masked[kept], logits[kept])


def permuted_distribution(probs: list[float], seed: int):
    """Logits over a shuffled vocabulary with these probabilities, and the shuffle."""
    order = torch.randperm(len(probs), generator=torch.Generator().manual_seed(seed))
    logits = torch.empty(len(probs))
    logits[order] = torch.tensor(probs).log()
    return logits, order  # token order[i] has probability probs[i]


@pytest.mark.parametrize("top_p, nucleus_size", [(0.4, 1), (0.7, 2), (0.9, 3), (0.97, 4), (1.0, 5)])
def test_top_p_keeps_the_smallest_nucleus(top_p, nucleus_size):
    probs = [0.5, 0.3, 0.15, 0.04, 0.01]  # cumulative 0.5, 0.8, 0.95, 0.99, 1.0
    logits, order = permuted_distribution(probs, seed=nucleus_size)
    kept = torch.isfinite(top_p_mask(logits[None], torch.tensor([top_p]))[0])
    assert set(kept.nonzero().flatten().tolist()) == set(order[:nucleus_size].tolist())
    drawn = draw_many(logits[None], SamplingParams(top_p=top_p), 4000)
    assert set(drawn.tolist()) == set(order[:nucleus_size].tolist())


def test_top_p_equal_to_a_cumulative_mass_keeps_only_the_tokens_before_it():
    # The best token alone holds exactly top_p: the nucleus is complete without the runners-up,
    # whose better-token mass (0.5) equals top_p exactly.
    logits, order = permuted_distribution([0.5, 0.25, 0.25], seed=0)
    probs = logits.softmax(-1)
    assert probs[order].tolist() == [0.5, 0.25, 0.25]  # exact in float32: the boundary really is hit
    drawn = draw_many(logits[None], SamplingParams(top_p=0.5), 12_000)
    assert set(drawn.tolist()) == {int(order[0])}


# ---------------------------------------------------------------- exact distribution


@pytest.mark.parametrize("by", ["seed", "position"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draw_frequencies_match_softmax(temperature, by):
    logits = random_logits(3, 1, vocab=12, scale=1.5)
    drawn = draw_many(logits, SamplingParams(temperature=temperature, seed=10), 20_000, by=by)
    chi2, dof = chi_square(drawn, torch.softmax(logits[0] / temperature, -1))
    assert chi2 < chi_square_bound(dof)


def test_draw_frequencies_with_top_k_match_the_renormalised_k_best():
    logits = random_logits(4, 1, vocab=12, scale=1.5)
    best = logits[0].topk(4).indices
    probs = torch.zeros(12)
    probs[best] = torch.softmax(logits[0, best], -1)
    drawn = draw_many(logits, SamplingParams(top_k=4, seed=99), 20_000)
    chi2, dof = chi_square(drawn, probs)
    assert chi2 < chi_square_bound(dof)


def test_chi_square_bound_rejects_a_wrong_distribution():
    # The bound above must be tight enough to catch a sampler at the wrong temperature.
    logits = random_logits(3, 1, vocab=12, scale=1.5)
    drawn = draw_many(logits, SamplingParams(temperature=1.0, seed=10), 20_000)
    chi2, dof = chi_square(drawn, torch.softmax(logits[0] / 1.2, -1))
    assert chi2 > chi_square_bound(dof)


def test_token_logprobs_are_the_log_softmax():
    logits = random_logits(5, 3)
    tokens = torch.tensor([0, 17, 255])
    expected = torch.log_softmax(logits, -1)[torch.arange(3), tokens]
    torch.testing.assert_close(token_logprobs(logits, tokens), expected)
    every = torch.stack([token_logprobs(logits, torch.full((3,), token)) for token in range(VOCAB)], dim=-1)
    torch.testing.assert_close(every.exp().sum(-1), torch.ones(3))


# ---------------------------------------------------------------- forcing


def test_force_tokens_keeps_forced_values_and_samples_elsewhere():
    sampled = torch.tensor([3, 4, 5, 6, 7])
    forced = torch.tensor([-1, 9, -1, 0, 255])
    assert force_tokens(sampled, forced).tolist() == [3, 9, 5, 0, 255]


# ---------------------------------------------------------------- generate with a model

PROMPT_LEN, TOTAL_LEN = 5, 30


def test_generate_row_is_the_same_alone_or_in_a_batch(kind):
    model = shared_tiny_model(kind)
    prompts = random_bytes(1, 4, PROMPT_LEN)
    params = [
        SamplingParams(seed=11),
        SamplingParams(temperature=0.8, top_k=40, seed=12),
        SamplingParams(temperature=1.2, top_p=0.9, seed=13),
        SamplingParams(seed=14),
    ]
    together = generate(model, prompts, TOTAL_LEN, batch_of(params))
    assert together.shape == (4, TOTAL_LEN)
    assert torch.equal(together[:, :PROMPT_LEN], prompts)
    for row in (1, 2):
        alone = generate(model, prompts[row : row + 1], TOTAL_LEN, batch_of([params[row]]))
        assert torch.equal(alone[0], together[row])
    reseeded = generate(model, prompts[:1], TOTAL_LEN, batch_of([SamplingParams(seed=99)]))
    assert not torch.equal(reseeded[0], together[0])


def test_greedy_generate_picks_the_argmax_of_its_own_sequence(kind):
    model = shared_tiny_model(kind)
    prompts = random_bytes(2, 2, PROMPT_LEN)
    tokens = generate(model, prompts, TOTAL_LEN, batch_of([SamplingParams(temperature=0.0)] * 2))
    with torch.no_grad():
        logits, _ = model(with_bos(tokens), None)  # logits[:, t] predicts tokens[:, t]
    assert torch.equal(tokens[:, PROMPT_LEN:], logits[:, PROMPT_LEN:].argmax(-1))


def test_generate_draws_each_token_with_its_own_position(kind):
    # The uniform for token t is keyed by (seed, t): redrawing from the parallel logits
    # of the finished sequence must give back every generated token.
    model = shared_tiny_model(kind)
    prompts = random_bytes(5, 2, PROMPT_LEN)
    params = batch_of([SamplingParams(seed=21), SamplingParams(temperature=0.9, top_p=0.95, seed=22)])
    tokens = generate(model, prompts, TOTAL_LEN, params)
    with torch.no_grad():
        logits, _ = model(with_bos(tokens), None)
    for t in range(PROMPT_LEN, TOTAL_LEN):
        redrawn = sample(logits[:, t], params, torch.full((2,), t))
        assert torch.equal(redrawn, tokens[:, t]), f"position {t}"


def test_generate_keeps_forced_tokens_and_conditions_on_them():
    model = shared_tiny_model("linear")
    known = random_bytes(3, 1, TOTAL_LEN)
    forced = torch.full((1, TOTAL_LEN), -1)
    forced[0, :8] = known[0, :8]  # a known prefix, as in an occluded image
    forced[0, 20] = known[0, 20]  # and a known pixel after the first unknown one
    params = batch_of([SamplingParams(seed=5)])
    from_forcing = generate(model, known[:, :0], TOTAL_LEN, params, forced=forced)
    assert torch.equal(from_forcing[0, :8], known[0, :8])
    assert int(from_forcing[0, 20]) == int(known[0, 20])
    # Forced tokens are fed back like prompt tokens: the same draws follow.
    from_prompt = generate(model, known[:, :8], TOTAL_LEN, params, forced=forced)
    assert torch.equal(from_prompt, from_forcing)
