"""`rnnserve eval --completions --particles K`: completions by the server's own particle sampler.

Sequential Monte Carlo lives in the engine (its rules in model/decode/particles.py): each digit
is one request with K particles, queued on an in-process engine whose slots
hold `rows` particles at once, so the evaluation runs exactly the code a
request to /v1/images/completions runs. Digit i draws with seed
seed * SEED_STRIDE + i, as the plain sampler does, so particles=1 gives the
plain sampler's completions.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from model import Transformer
from model.decode.sampling import SamplingParams
from model.decode.particles import ParticleSummary
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput
from server.engine.types import GenerationRequest, SampleResult


@dataclass(frozen=True)
class ParticleCompletions:
    images: torch.Tensor  # (N, 784) uint8
    summaries: list[ParticleSummary]  # one per digit

    @property
    def mean_resamplings(self) -> float:
        return sum(s.resamplings for s in self.summaries) / len(self.summaries)


def complete_with_particles(
    model: Transformer,
    forced: torch.Tensor,
    first_unknown: int,
    seeds: list[int],
    temperature: float,
    particles: int,
    rows: int,
) -> ParticleCompletions:
    """(N, 784) known grey levels (-1 unknown) -> completions; `rows` decode slots (>= particles)."""
    engine = Engine(
        "eval",
        model,
        {},
        EngineLimits(max_batch=max(rows, particles), max_waiting=len(seeds), cuda_graphs=False),
        LocalOutput(),
    )
    engine.start()
    try:
        results = asyncio.run(_complete(engine, forced, first_unknown, seeds, temperature, particles))
    finally:
        engine.stop()
    images = torch.stack([torch.tensor(r[0], dtype=torch.uint8) for r in results])
    return ParticleCompletions(images, [r[1] for r in results])


async def _complete(
    engine: Engine, forced: torch.Tensor, first_unknown: int, seeds: list[int], temperature: float, particles: int
) -> list[tuple[list[int], ParticleSummary]]:
    streams = [
        engine.submit(_request(i, row, first_unknown, seed, temperature, particles), each_event=False)
        for i, (row, seed) in enumerate(zip(forced.tolist(), seeds))
    ]
    done = []
    for row, stream in zip(forced.tolist(), streams):
        (result,) = [r async for r in stream]
        # Not streamed, with particles: one whole sample, with its particles' summary.
        assert isinstance(result, SampleResult) and result.particles is not None
        done.append((row[:first_unknown] + result.tokens, result.particles))
    return done


def _request(
    i: int, row: list[int], first_unknown: int, seed: int, temperature: float, particles: int
) -> GenerationRequest:
    known_after = {p: v for p, v in enumerate(row) if p > first_unknown and v >= 0}
    return GenerationRequest(
        f"digit-{i}",
        row[:first_unknown],
        len(row) - first_unknown,
        SamplingParams(temperature=temperature, seed=seed),
        forced=known_after,
        particles=particles,
    )
