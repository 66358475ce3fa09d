"""The data one engine step passes along, as vLLM's engine core does: plain objects, each made by one part.

Scheduler.plan_step()   -> SchedulerOutput   which rows run, how many steps, what they ask for
ModelRunner.execute()   -> RunnerOutput      the drawn tokens (host lists) and the known tokens' weights
Scheduler.update()      -> StepUpdate        rows advanced, finished, resampled; what to read and move
ModelRunner.read_samples() -> finished rows' whole samples (host lists)
step_events()           -> the events per request (pure)
Scheduler.make_stats()  -> StepStats         the figures, recorded where the events arrive (server/engine/output.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from model.particles import RowCopy
from server.engine.types import TopLogprobs


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
    def of(cls, owners) -> "StepNeeds":
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


@dataclass
class RunnerOutput:
    """What the runner drew in one pass, for rows [0, n)."""

    tokens: list[list[int]]  # (n, steps run): each row's tokens, the last step's last
    last: torch.Tensor  # (n,) the last step's tokens, on the device: what the pass's closing forward feeds
    logprobs: list[float] | None  # (n,) the last step's tokens' log-probabilities, when a row asks
    top_ids: list[list[int]] | None  # (n, MAX_TOP_LOGPROBS), when a row asks
    top_values: list[list[float]] | None
    known_logprobs: list[float]  # per SchedulerOutput.known row: its known token's log-probability (its weight)
    started: float  # time.monotonic() when the pass began
    ahead_seconds: float = 0.0  # time spent in the unwatched steps before the last

    @property
    def steps(self) -> int:
        return len(self.tokens[0]) if self.tokens else 1


@dataclass
class StepUpdate:
    """What the scheduler made of a pass's tokens (computed before rows move)."""

    outcome: StepOutcome
    copies: list[RowCopy]  # resampling: rows that take another row's state, history and token
    resamplings: int  # samples resampled


SampleRead = tuple[list[int], "list[float] | None", "list[TopLogprobs] | None"]  # tokens, logprobs, top
