"""The data one engine pass hands along, as vLLM's engine core does: each object made by one part, read by the next,
edited by none.

Scheduler.schedule()           -> SchedulerOutput  which rows run, how many steps at most, what they ask for
ModelRunner.execute()          -> RunnerOutput     the drawn tokens (host lists) and the known tokens' weights
                                                   (the engine runs the unwatched steps before it, one call each,
                                                   and decides between two of them whether the run ends early)
Scheduler.update_from_output() -> StepUpdate       rows advanced, finished, resampled; the row copies, sample reads
                                                   and compaction moves the runner makes; the pass's figures
ModelRunner.apply()            -> AppliedStep      the finished rows' whole samples, the state bytes in use
step_results()                 -> StepStats and the events per request (pure), to the engine's output
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

import torch

from model.decode.particles import RowCopy
from server.engine.types import GenerationRequest, StepStats, TopLogprobs


@dataclass
class StepOutcome:
    """What one step's tokens did to the row map (computed before rows move)."""

    reasons: list[str | None]  # per row: finish reason, "cancelled", or None while running
    finished: list[int] = field(default_factory=list)  # rows that left, in row order
    completed: list[Any] = field(default_factory=list)  # requests (Submissions) none of whose rows is left
    tokens: int = 0  # tokens drawn (cancelled rows draw none)
    first_token_seconds: list[float] = field(default_factory=list)
    token_gaps: dict[float, int] = field(default_factory=dict)  # see _time_tokens


CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class StepNeeds:
    """What the live rows ask of a step beyond a token: the step skips what no row asks for."""

    logprobs: bool = False  # each token's log-probability
    top: bool = False  # the most likely tokens at each position
    adjust: bool = False  # penalties or logit bias
    weigh: bool = False  # particles weighed by known tokens
    filters: bool = False  # top-k or top-p
    forced: bool = False  # known tokens to keep instead of the drawn ones
    each_step: bool = False  # a client sees every step (streamed tokens, particles' progress and resampling)

    @classmethod
    def of(cls, owners: Iterable[Any]) -> StepNeeds:
        owners = list(owners)
        requests = [o.request for o in owners]
        return cls(
            logprobs=any(r.wants_logprobs for r in requests),
            top=any(r.top_logprobs for r in requests),
            adjust=any(r.sampling.adjusts_logits for r in requests),
            weigh=any(r.weighs_known for r in requests),
            filters=any(r.sampling.filters for r in requests),
            forced=any(r.forced for r in requests),
            each_step=any(o.each_event or o.request.steps_each for o in owners),
        )


@dataclass(frozen=True)
class SchedulerOutput:
    """What the scheduler asks of one pass: rows [0, rows), up to `steps` decode steps, and what they need."""

    rows: int
    steps: int  # >= 1; the steps before the last are unwatched (multi-step), and the run may end early
    needs: StepNeeds
    known: list[int] = field(default_factory=list)  # rows whose next token is known and weighed (particles)


@dataclass(frozen=True)
class RunnerOutput:
    """What the runner drew in one pass, for rows [0, n)."""

    tokens: list[list[int]]  # (n, steps run): each row's tokens, the last step's last
    last: torch.Tensor  # (n,) the last step's tokens, on the device: what the pass's closing forward feeds
    logprobs: list[float] | None  # (n,) the last step's tokens' log-probabilities, when a row asks
    top_ids: list[list[int]] | None  # (n, MAX_TOP_LOGPROBS), when a row asks
    top_values: list[list[float]] | None
    known_logprobs: list[float]  # per SchedulerOutput.known row: its known token's log-probability (its weight)
    started: float  # time.monotonic() when the pass began
    ended: float  # time.monotonic() when its last step's tokens were drawn

    @property
    def steps(self) -> int:
        return len(self.tokens[0]) if self.tokens else 1


SampleRead = tuple[list[int], "list[float] | None", "list[TopLogprobs] | None"]  # tokens, logprobs, top


@dataclass(frozen=True)
class SampleSpan:
    """A finished row's whole sample for the runner to read: positions [start, end) and what its request asks."""

    start: int
    end: int
    request: GenerationRequest


@dataclass(frozen=True)
class StepUpdate:
    """What the scheduler made of a pass's tokens, and what the runner is to do about it, in its order: copy the
    resampled rows, read the finished samples (rows not moved yet), then move rows into the holes."""

    rows: tuple[Any, ...]  # the scheduler's Sequences as they were before compaction, row by row (for the events)
    tokens: list[list[int]]  # (n, steps run): each row's tokens after resampling (a copy takes its source's)
    outcome: StepOutcome
    copies: list[RowCopy]  # resampling: rows that take another row's state, history and token
    reads: dict[int, SampleSpan]  # finished rows whose whole sample goes out
    moves: list[tuple[int, int]]  # compaction: (src, dst) rows, every source past `live`, every destination in it
    live: int  # rows left running: the closing forward feeds rows [0, live)
    stats: StepStats  # the pass's figures but for what the runner and the clock know (state_bytes, seconds)


@dataclass(frozen=True)
class AppliedStep:
    """What the runner did with a StepUpdate: the samples it read, and the state its live rows hold."""

    samples: dict[int, SampleRead]
    state_bytes: int
