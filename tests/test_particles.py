"""Sequential Monte Carlo over decoding rows (model/decode/particles.py), against exact enumeration.

A tiny model is trained for a few seconds on a toy language of four tokens
where each unknown token is echoed by the known one after it (x1 = x0,
x3 = x2, mostly). With x0 and x2 unknown and x1, x3 known, the exact
conditional p(x0, x2 | x1, x3) is enumerated over all 256 x 256 completions
in one batched forward. Samples drawn by a real engine thread with particles
match it within a bound computed from the sample count; plain forced sampling
(particles=1), which never looks ahead, does not. Distributions are compared
on the 16 outcomes of the toy alphabet plus one cell for everything else.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest
import torch

from model.config import BOS_TOKEN
from model.decode.sampling import SamplingParams
from model.transformer import Transformer
from model.decode import particles as smc
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput
from server.engine.types import GenerationRequest
from server.engine.validation import InvalidRequest
from conftest import make_tiny_model

LENGTH = 4
KNOWN = {1: 1, 3: 3}  # x1 and x3 known; x0 and x2 unknown
UNKNOWN = (0, 2)
ALPHABET = 4
ECHO = 0.7
SAMPLES = 1024
PARTICLES = 16
PER_REQUEST = 8  # samples per request: 8 x 16 particles = 128 rows


def toy_batch(gen: torch.Generator, batch: int) -> torch.Tensor:
    """(batch, 4) sequences over tokens 0..3: x0, x2 uniform; x1 = x0 and x3 = x2 with probability ECHO."""
    x = torch.randint(0, ALPHABET, (batch, LENGTH), generator=gen)
    echo = torch.rand(batch, 2, generator=gen) < ECHO
    x[:, 1::2] = torch.where(echo, x[:, 0::2], x[:, 1::2])
    return x


def train_toy_model(kind: str) -> Transformer:
    """A tiny model fitted to the toy language (a few hundred Adam steps: seconds)."""
    model = make_tiny_model(kind, seed=0, max_len=8, reformer_local_window=4).train()
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        x = toy_batch(gen, 64)
        inputs = torch.cat([torch.full((64, 1), BOS_TOKEN), x[:, :-1]], dim=1)
        logits, _ = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def exact_conditional(model: Transformer) -> tuple[dict[tuple[int, int], float], float]:
    """p(x0, x2 | known) on the toy alphabet's 16 outcomes plus None for the rest, from all 256^2
    completions; and log p(known)."""
    grid = torch.cartesian_prod(torch.arange(256), torch.arange(256))  # (65536, 2)
    full = torch.stack(
        [grid[:, 0], torch.full_like(grid[:, 0], KNOWN[1]), grid[:, 1], torch.full_like(grid[:, 0], KNOWN[3])], dim=1
    )  # (65536, 4)
    inputs = torch.cat([torch.full((len(full), 1), BOS_TOKEN), full[:, :-1]], dim=1)
    with torch.inference_mode():
        logits, _ = model(inputs)
    joint = torch.log_softmax(logits.double(), -1).gather(-1, full[..., None])[..., 0].sum(-1)  # (65536,)
    log_known = torch.logsumexp(joint, 0)
    cells: Counter = Counter()
    for (a, b), p in zip(grid.tolist(), (joint - log_known).exp().tolist()):
        cells[cell((a, b))] += p
    return dict(cells), float(log_known)


def cell(pair: tuple[int, int]) -> tuple[int, int] | None:
    return pair if max(pair) < ALPHABET else None


def draw(model: Transformer, particles: int, samples: int = SAMPLES, first_seed: int = 0) -> list:
    """`samples` completions by a real engine: their (x0, x1) and particle summaries."""
    engine = Engine(
        "toy",
        model,
        {},
        EngineLimits(max_batch=PER_REQUEST * particles, max_waiting=512, cuda_graphs=False),
        LocalOutput(),
    )
    engine.start()

    async def run() -> list:
        streams = [
            engine.submit(toy_request(f"r{i}", particles, first_seed + i * PER_REQUEST), each_event=False)
            for i in range(samples // PER_REQUEST)
        ]
        return [result for stream in streams async for result in stream]

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def toy_request(request_id: str, particles: int, seed: int) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        [],
        max_new_tokens=LENGTH,
        sampling=SamplingParams(seed=seed),
        n=PER_REQUEST,
        forced=dict(KNOWN),
        particles=particles,
    )


def total_variation(samples: list, exact: dict[tuple[int, int], float]) -> float:
    counts = Counter(cell(tuple(r.tokens[i] for i in UNKNOWN)) for r in samples)
    seen = sum(abs(c / len(samples) - exact[k]) for k, c in counts.items())
    unseen = sum(p for k, p in exact.items() if k not in counts)
    return 0.5 * (seen + unseen)


def tv_bound(exact: dict[tuple[int, int], float], n: int) -> float:
    """Four times a bound on the expected total variation of n exact draws (0.5 sum sqrt(p(1-p)/n)),
    plus 0.02 for the O(1/particles) bias of drawing one particle from a finite set."""
    return 4 * 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values()) + 0.02


@pytest.fixture(scope="module", params=["linear", "softmax", "linformer", "reformer"])
def toy(request) -> tuple[Transformer, dict, float]:
    model = train_toy_model(request.param)
    return (model, *exact_conditional(model))


@pytest.mark.slow  # its fixture trains a toy model for each kind
def test_particle_samples_match_the_exact_conditional(toy):
    model, exact, _ = toy
    assert max(exact.values()) < 0.9  # a distribution to match, not one point
    tv = total_variation(draw(model, PARTICLES), exact)
    assert tv < tv_bound(exact, SAMPLES), (tv, tv_bound(exact, SAMPLES))


def test_forced_sampling_misses_the_exact_conditional(toy):
    """The same check fails for particles=1: without weights x0, x2 ignore the known x1, x3."""
    model, exact, _ = toy
    tv = total_variation(draw(model, 1), exact)
    assert tv > 2 * tv_bound(exact, SAMPLES), (tv, tv_bound(exact, SAMPLES))


def test_likelihood_estimate_comes_close_to_log_p_known(toy):
    """Each sample's estimate of p(known) is unbiased: their mean in probability is within four standard
    errors (from the estimates' own spread and count) of the exact value."""
    model, _, log_known = toy
    results = draw(model, PARTICLES, samples=512)
    assert {r.particles.particles for r in results} == {PARTICLES}
    estimates = torch.tensor([r.particles.known_log_likelihood for r in results], dtype=torch.float64)
    ratios = (estimates - log_known).exp()  # estimate / exact
    standard_error = float(ratios.std() / ratios.mean() / math.sqrt(len(ratios)))
    assert abs(smc.log_mean_exp(estimates.tolist()) - log_known) < 4 * standard_error + 0.01


def test_seeds_reproduce_and_rows_do_not_matter(toy):
    """The same seeds give the same completions and summaries, alone or behind another request."""
    model, _, _ = toy
    alone = draw(model, PARTICLES, samples=16, first_seed=7)
    again = draw(model, PARTICLES, samples=16, first_seed=7)
    assert [(r.tokens, r.particles) for r in alone] == [(r.tokens, r.particles) for r in again]
    other = draw(model, PARTICLES, samples=16, first_seed=8)
    assert [r.tokens for r in alone] != [r.tokens for r in other]


def test_neighbours_of_resampling_rows_get_their_solo_tokens(toy):
    """Resampling copies rows only within a request's own particles: a plain request decoding in the same
    batch draws exactly what it draws alone, and so does the particle request."""
    model, _, _ = toy
    plain = GenerationRequest("plain", [2], max_new_tokens=3, sampling=SamplingParams(seed=5), n=3, logprobs=True)
    weighed = toy_request("smc", PARTICLES, seed=11)

    def run(requests: list[GenerationRequest]) -> dict[str, list]:
        engine = Engine("toy", model, {}, EngineLimits(max_batch=160, max_waiting=8, cuda_graphs=False), LocalOutput())
        return asyncio.run(_results(engine, requests))

    together, alone = run([weighed, plain]), run([plain])
    assert sum(r.particles.resamplings for r in together["smc"]) > 0  # the neighbour did resample
    assert [r.tokens for r in together["plain"]] == [r.tokens for r in alone["plain"]]
    for joint, solo in zip(together["plain"], alone["plain"]):  # batch size moves float sums by ~1e-7
        assert joint.logprobs == pytest.approx(solo.logprobs, abs=1e-5)
    assert [r.tokens for r in together["smc"]] == [r.tokens for r in run([weighed])["smc"]]


async def _results(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list]:
    """Queue every request before the engine starts, so they share its first steps."""
    streams = {r.request_id: engine.submit(r, each_event=False) for r in requests}
    engine.start()
    try:
        return {name: [result async for result in stream] for name, stream in streams.items()}
    finally:
        engine.stop()


def test_particles_count_against_the_slots():
    model = make_tiny_model("linear", seed=0, max_len=8)
    engine = Engine("toy", model, {}, EngineLimits(max_batch=32, max_waiting=8, cuda_graphs=False), LocalOutput())
    too_many = GenerationRequest("big", [], LENGTH, n=4, forced=dict(KNOWN), particles=16)
    with pytest.raises(InvalidRequest, match=r"n \(4\) x particles \(16\) = 64 decode slots; this server has 32"):
        asyncio.run(_submit(engine, too_many))


async def _submit(engine: Engine, request: GenerationRequest):
    return engine.submit(request, each_event=False)


# -- the host-side pieces -----------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[0.25] * 4, [0.7, 0.1, 0.1, 0.1], [1.0, 0, 0, 0], [0.05, 0.45, 0.05, 0.45]])
@pytest.mark.parametrize("u", [0.0, 0.37, 0.999])
def test_systematic_resampling_gives_each_particle_its_share(weights, u):
    """Offspring of particle i is floor or ceil of K w_i, and the copies never overwrite a source."""
    logs = [math.log(w) if w else -math.inf for w in weights]
    ancestors = smc.systematic_ancestors(logs, u)
    k = len(weights)
    for i, w in enumerate(weights):
        assert math.floor(k * w) - 1e-9 <= ancestors.count(i) <= math.ceil(k * w) + 1e-9
    copies = smc.copies_for(ancestors)
    sources, targets = {src for src, _ in copies}, [dst for _, dst in copies]
    assert not sources & set(targets) and len(set(targets)) == len(targets)
    final = list(range(k))
    for src, dst in copies:
        final[dst] = src
    assert sorted(final) == sorted(ancestors)


def test_effective_sample_size_and_log_mean_exp():
    assert smc.effective_sample_size([0.0] * 8) == pytest.approx(8)
    assert smc.effective_sample_size([0.0] + [-math.inf] * 7) == pytest.approx(1)
    assert smc.effective_sample_size([-math.inf] * 4) == pytest.approx(4)  # all zero: treated as equal
    assert smc.log_mean_exp([math.log(1), math.log(3)]) == pytest.approx(math.log(2))
    assert smc.log_mean_exp([-math.inf, -math.inf]) == -math.inf
