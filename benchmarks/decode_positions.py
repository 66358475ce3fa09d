"""Time of one decoding step and decode-state bytes per sequence against position, on a text-shaped copy of the
architecture whose state is advanced by chunked prefills of random tokens; for the constant-state kinds, also steps
timed in alternation on two states, near position 100 and 16,000 (the flatness figure the targets use)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from model.decode.choice import make_decoder
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.transformer import Transformer

from .decode_settings import DecodeSettings
from .decode_timing import timed
from .errors import BenchError

PREFILL_CHUNK = 256  # tokens per prefill call while advancing a state: bounds the (T, L) masks
STEP_ROUNDS = 4  # turns the kinds take at each position of the step-time sweep
# Flatness of constant-state kinds: step time at the position nearest FLAT_FAR against nearest FLAT_NEAR.
FLAT_NEAR, FLAT_FAR = 100, 16000
FLAT_ROUNDS, FLAT_STEPS_PER_ROUND = 32, 2


@dataclass
class PositionPoint:
    position: int  # tokens already in the state when the step runs
    step_seconds_min: float
    step_seconds_median: float
    state_bytes_per_sequence: int


@dataclass
class FlatnessResult:
    """A constant-state kind's step time far into a sequence against near its start."""

    kind: str
    near: int  # positions of the two states when timing began
    far: int
    near_seconds_median: float
    far_seconds_median: float
    near_seconds_min: float
    far_seconds_min: float
    ratio: float  # far / near, medians of steps timed in alternation
    steps: int  # per position


class PositionPeer(Protocol):
    """Another engine's decoding steps in the position sweep (benchmarks/llamacpp_peer.py): its rows' sequences
    advanced to a position, then single steps timed there, in the same turns as rnnserve's kinds."""

    def position(self) -> int: ...  # tokens already in every row's sequence

    def advance_to(self, position: int) -> None: ...

    def time_steps(self, steps: int) -> list[float]: ...  # seconds of each step, one token per row

    def state_bytes_per_sequence(self) -> int: ...


class _DecoderSteps:
    """An rnnserve model's decoder as the sweep drives it: prefilled with random tokens, stepped on token 0."""

    def __init__(self, model: Transformer, settings: DecodeSettings, batch: int):
        self.model, self.decoder = model, step_decoder(model, settings, batch)
        self.gen = torch.Generator().manual_seed(settings.seed)

    def position(self) -> int:
        return int(self.decoder.state.lengths[0])

    def advance_to(self, position: int) -> None:
        _advance(self.model, self.decoder.state, position, self.gen)

    def time_steps(self, steps: int) -> list[float]:
        return _time_steps(self.decoder, steps)

    def state_bytes_per_sequence(self) -> int:
        return self.decoder.state.nbytes_in_use() // self.decoder.state.batch_size


def choose_positions(max_position: int) -> list[int]:
    """Default sample positions: 100 and 16,000 (the issue's targets) plus a spread up to max_position."""
    wanted = [100, 1000, 2000, 4000, 8000, 12000, 16000, max_position]
    chosen = sorted({p for p in wanted if 1 <= p <= max_position})
    if len(chosen) < 4:
        chosen = sorted({max(1, int(p)) for p in np.linspace(max_position / 8, max_position, 4)})
    return chosen


@torch.inference_mode()
def _advance(model: Transformer, state, target: int, gen: torch.Generator) -> None:
    """Prefill random tokens in chunks until every row holds `target` tokens."""
    batch = state.batch_size
    while int(state.lengths[0]) < target:
        n = min(PREFILL_CHUNK, target - int(state.lengths[0]))
        chunk = torch.randint(0, 256, (batch, n), generator=gen).to(model.device)  # (B, n)
        model(chunk, state)


@torch.inference_mode()
def step_decoder(model: Transformer, settings: DecodeSettings, batch: int) -> EagerDecoder:
    """A decoder as the server makes it (compiled here and now when it is compiled) on a new state."""
    decoder = make_decoder(
        model, model.new_state(batch), settings.cuda_graphs, sizes=[batch], compiled=settings.compiled
    )
    decoder.compile(batch=batch)
    return decoder


@torch.inference_mode()
def measure_positions(
    models: dict[str, Transformer],
    positions: list[int],
    settings: DecodeSettings,
    progress,
    peers: dict[str, PositionPeer] | None = None,
) -> dict[str, list[PositionPoint]]:
    """Per kind, one state advanced through increasing positions; timed single-token steps at each,
    through the decoder the server would use (compiled, CUDA graphs or eager). `peers`, when given,
    are other engines stepped the same way in the same turns, under their own names.

    At each position the kinds take turns in a few rounds, so a noisy spell
    on a shared machine does not land on one kind only.
    """
    contestants: dict[str, PositionPeer] = {
        kind: _DecoderSteps(model, settings, settings.position_batch) for kind, model in models.items()
    }
    contestants |= peers or {}
    points: dict[str, list[PositionPoint]] = {name: [] for name in contestants}
    rounds = min(STEP_ROUNDS, settings.steps_per_position)
    for contestant in contestants.values():  # warm-up, untimed: first calls allocate and pick kernels
        contestant.time_steps(2)
    for pos in positions:
        times: dict[str, list[float]] = {name: [] for name in contestants}
        for contestant in contestants.values():
            if pos < contestant.position():
                raise BenchError(
                    f"positions must grow by more than --steps-per-position; {pos} is too close to the one before"
                )
            contestant.advance_to(pos)
        state_bytes = {name: c.state_bytes_per_sequence() for name, c in contestants.items()}
        for r in range(rounds):
            steps = settings.steps_per_position // rounds + (r < settings.steps_per_position % rounds)
            for name, contestant in contestants.items():
                times[name] += contestant.time_steps(steps)
        for name, t in times.items():
            points[name].append(PositionPoint(pos, min(t), statistics.median(t), state_bytes[name]))
        progress(
            f"steps   at {pos:6d}: "
            + ", ".join(f"{k} {p[-1].step_seconds_min * 1e3:.3f} ms" for k, p in points.items())
        )
    return points


@torch.inference_mode()
def measure_flatness(
    models: dict[str, Transformer], near: int, far: int, settings: DecodeSettings, progress
) -> list[FlatnessResult]:
    """Kinds with a constant-size state: one state at `near`, one at `far`, single steps timed
    in alternation (FLAT_ROUNDS rounds, the order flipping each round). The sweep visits each
    position once, so a slow spell of a shared machine there can double one position's time;
    here both positions sample the same spells, and the ratio of medians cancels them."""
    results = []
    for kind, model in models.items():
        if not model.capabilities.constant_state:
            continue
        decoders = {pos: step_decoder(model, settings, 1) for pos in (near, far)}
        for pos, decoder in decoders.items():
            _advance(model, decoder.state, pos, torch.Generator().manual_seed(settings.seed))
        times: dict[int, list[float]] = {near: [], far: []}
        for r in range(FLAT_ROUNDS):
            for pos in (near, far) if r % 2 == 0 else (far, near):
                times[pos] += _time_steps(decoders[pos], FLAT_STEPS_PER_ROUND)
        medians = {pos: statistics.median(t) for pos, t in times.items()}
        results.append(
            FlatnessResult(
                kind,
                near,
                far,
                medians[near],
                medians[far],
                min(times[near]),
                min(times[far]),
                medians[far] / medians[near],
                len(times[near]),
            )
        )
        progress(
            f"flat    {kind:9s}: {medians[far] * 1e3:.3f} ms at {far} vs {medians[near] * 1e3:.3f} ms at {near} "
            f"(medians of {len(times[near])} alternating steps): {results[-1].ratio:.2f}x"
        )
    return results


def _time_steps(decoder: EagerDecoder, steps: int) -> list[float]:
    token = torch.zeros(decoder.state.batch_size, dtype=torch.long, device=decoder.model.device)  # (B,)
    return [timed(lambda: decoder(token), decoder.model.device) for _ in range(steps)]


def closest(positions: list[int], target: int) -> int:
    return min(positions, key=lambda p: abs(p - target))
