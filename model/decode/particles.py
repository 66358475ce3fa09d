"""Sequential Monte Carlo over decoding rows: completions that honour known tokens after unknown ones.

Each sample of a request with `particles=K` runs K rows of the batch. A row
draws its free tokens from the model as usual; at a known token it takes the
token and multiplies its weight by the probability the sampling distribution
gave that token. When a sample's effective sample size falls below
RESAMPLE_BELOW x K, its rows are resampled (systematic): rows with no
offspring are overwritten by copies of rows with several, a row copy of the
decode state (a fixed-size state for linear attention, a cache for softmax).
At the end one particle per sample is drawn by weight. The running product
of mean weights, times the prompt's exact likelihood, estimates p(known
tokens).

Host-only and deterministic: every random choice is a hash of the request's
seed, the sample and the resampling round, so a result does not depend on
which rows the particles occupy or on what else is in the batch.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ParticleSummary:
    """How one sample's particles went: reported in the answer's usage."""

    particles: int
    resamplings: int
    effective_sample_size: float  # of the final weights, 1..particles
    known_log_likelihood: float  # estimate of log p(known tokens) in nats, prompt included


RESAMPLE_BELOW = 0.5  # resample when the effective sample size falls below this share of the particles
_SEED_BITS = 62


@dataclass(eq=False)  # groups are keys by identity
class ParticleGroup:
    """What the particles of one sample share."""

    seed: int  # the sample's seed (request seed + sample)
    particles: int
    log_z: float = 0.0  # log p(known tokens so far), estimated; starts at the prompt's exact value
    resamplings: int = 0
    chosen: int | None = None  # the particle drawn at the end
    summary: ParticleSummary | None = None


@dataclass(frozen=True, slots=True)
class RowCopy:
    """Resampling: row `dst` becomes a copy of row `src` and draws on with `seed`."""

    src: int
    dst: int
    seed: int


def mixed_seed(*values: int) -> int:
    """A 62-bit seed from integers (a hash: nearby inputs give unrelated seeds)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def particle_seed(sample_seed: int, particle: int, round_: int = 0) -> int:
    """Particle 0 of round 0 draws with the sample's own seed, so particles=1 is plain sampling."""
    if particle == 0 and round_ == 0:
        return sample_seed
    return mixed_seed(sample_seed, particle, round_)


def log_mean_exp(values: list[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return -math.inf
    return top + math.log(sum(math.exp(v - top) for v in values) / len(values))


def normalized(log_weights: list[float]) -> list[float]:
    """Weights summing to 1; equal weights when every particle has probability 0."""
    top = max(log_weights)
    if top == -math.inf:
        return [1 / len(log_weights)] * len(log_weights)
    w = [math.exp(v - top) for v in log_weights]
    total = sum(w)
    return [x / total for x in w]


def effective_sample_size(log_weights: list[float]) -> float:
    """(sum w)^2 / sum w^2: K for equal weights, 1 when one particle holds them all."""
    return 1.0 / sum(w * w for w in normalized(log_weights))


def systematic_ancestors(log_weights: list[float], u: float) -> list[int]:
    """Systematic resampling with offset u in [0, 1): the points (u + j) / K, j < K, fall into the
    particles' weight intervals; K ancestors in order, particle i taken floor or ceil of K w_i times."""
    weights, k = normalized(log_weights), len(log_weights)
    ancestors: list[int] = []
    edge = 0.0  # K x the weight of particles 0..i
    for i, w in enumerate(weights):
        edge += k * w
        # points below the edge: j < edge - u; the 1e-9 keeps a float sum like 1.0000000002 from adding one
        below = k if i == k - 1 else min(k, max(len(ancestors), math.ceil(edge - u - 1e-9)))
        ancestors += [i] * (below - len(ancestors))
    return ancestors


def copies_for(ancestors: list[int]) -> list[tuple[int, int]]:
    """(src, dst) particle copies that realise `ancestors`: every particle with offspring stays in place,
    its extra offspring overwrite particles with none (so no source is overwritten)."""
    offspring = [0] * len(ancestors)
    for a in ancestors:
        offspring[a] += 1
    free = [p for p, count in enumerate(offspring) if count == 0]
    extra = [p for p, count in enumerate(offspring) for _ in range(count - 1)]
    return list(zip(extra, free))


def uniform(*key: int) -> float:
    return random.Random(mixed_seed(*key)).random()


class Particle(Protocol):
    """What the particle rules read and write of a row's sequence (the engine's Sequence, server/engine/scheduler.py)."""

    particle: int  # which of its sample's particles
    log_weight: float
    group: "ParticleGroup | None"
    position: int

    @property
    def owner(self) -> Any: ...  # its submission: `.request` (forced tokens, max_new_tokens)

    @property
    def start(self) -> int: ...


def known_rows(rows: Sequence[Particle]) -> list[int]:
    """Rows of weighed requests whose next token is a known one."""
    return [i for i, seq in enumerate(rows) if seq.group is not None and seq.position in seq.owner.request.forced]


@dataclass
class Resampling:
    """What a step's weighing asks of the rows: copies, and how many samples were resampled."""

    copies: list[RowCopy]
    samples: int


def weigh(rows: Sequence[Particle], known: list[int], logprobs: list[float]) -> Resampling:
    """Add each known token's log-probability to its row's weight; resample the samples whose
    effective sample size fell too low. The row copies to make, with the copies' new seeds."""
    groups: dict[ParticleGroup, list[int]] = {}
    for i, logprob in zip(known, logprobs):
        rows[i].log_weight += logprob
        group = rows[i].group
        assert group is not None, "a known row belongs to a weighed sample"  # known_rows picks rows with a group
        groups.setdefault(group, []).append(i)
    done = Resampling([], 0)
    for group, members in groups.items():
        members.sort(key=lambda i: rows[i].particle)  # particle order: independent of where rows sit
        weights = [rows[i].log_weight for i in members]
        last = rows[members[0]].position - rows[members[0]].start + 1 >= rows[members[0]].owner.request.max_new_tokens
        # At the last token no draw follows, so resampling would only add noise: `conclude` draws by weight.
        if group.particles > 1 and not last and effective_sample_size(weights) < RESAMPLE_BELOW * group.particles:
            done.copies += _resample(group, [rows[i] for i in members], members)
            done.samples += 1
    return done


def _resample(group: ParticleGroup, particles: Sequence[Particle], members: list[int]) -> list[RowCopy]:
    weights = [p.log_weight for p in particles]
    group.log_z += log_mean_exp(weights)
    group.resamplings += 1
    ancestors = systematic_ancestors(weights, uniform(group.seed, group.resamplings, 1))
    for p in particles:
        p.log_weight = 0.0
    return [
        RowCopy(members[src], members[dst], particle_seed(group.seed, dst, group.resamplings))
        for src, dst in copies_for(ancestors)
    ]


def conclude(group: ParticleGroup, particles: Sequence[Particle]) -> None:
    """A sample's particles have finished: draw the one it answers with, and sum up the run."""
    particles = sorted(particles, key=lambda p: p.particle)
    weights = [p.log_weight for p in particles]
    point = uniform(group.seed, group.resamplings, 2)
    cumulative = 0.0
    group.chosen = particles[-1].particle
    for p, w in zip(particles, normalized(weights)):
        cumulative += w
        if point < cumulative:
            group.chosen = p.particle
            break
    group.summary = ParticleSummary(
        group.particles,
        group.resamplings,
        round(effective_sample_size(weights), 3),
        group.log_z + log_mean_exp(weights),
    )
