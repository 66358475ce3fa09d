"""What one engine pass hands out: each request's events, built from the rows as they were before they moved, and
the pass's figures.

A streamed request gets a Generation per token; a non-streamed one a
SampleResult per finished sample, which the runner read for it in one go.
A request with particles (model/decode/particles.py) streams no tokens, since
resampling can still replace them: it gets Progress while its particles
run, and each sample's chosen particle as a SampleResult once it finishes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence as Rows
from dataclasses import replace
from typing import cast

from server.engine.scheduler import Sequence, Submission
from server.engine.step import CANCELLED, AppliedStep, RunnerOutput, SampleRead, StepOutcome, StepUpdate
from server.engine.streams import DONE, EventTarget, Outbox
from server.engine.types import Generation, ParticleSummary, Progress, SampleResult, StepStats


def step_results(
    update: StepUpdate, output: RunnerOutput, applied: AppliedStep, seconds: float
) -> tuple[StepStats, Outbox]:
    """A pass's figures (its update's, with the state the runner holds and the pass's wall time) and its events."""
    stats = replace(update.stats, state_bytes=applied.state_bytes, seconds=seconds)
    return stats, step_events(update.rows, update.outcome, update.tokens, output, applied.samples)


def step_events(
    rows: Rows[Sequence],
    outcome: StepOutcome,
    tokens: list[list[int]],
    output: RunnerOutput,
    samples: dict[int, SampleRead],
) -> Outbox:
    """The step's events per request, DONE for each request that completed. `rows`: as they were before they
    moved; `tokens`: each row's, after resampling; `samples`: what the runner read of the rows the scheduler named."""
    outbox: Outbox = defaultdict(list)
    for i, (seq, reason) in enumerate(zip(rows, outcome.reasons)):
        stream = target(seq.owner)
        if reason == CANCELLED:
            continue
        if seq.group is not None and seq.group.particles > 1:
            _particle_event(outbox, seq, reason, samples.get(i))
        elif seq.owner.each_event:
            outbox[stream].append(generation(output, tokens[i][-1], i, seq, reason))
        elif reason is not None:
            outbox[stream].append(sample_result(seq, reason, samples[i]))
    for owner in outcome.completed:
        outbox[target(owner)].append(DONE)
    return outbox


def target(owner: Submission) -> EventTarget:
    """Where a row's events go: its submission, which in an engine is the request's GenerationStream."""
    return cast(EventTarget, owner)


def _particle_event(outbox: Outbox, seq: Sequence, reason: str | None, read: SampleRead | None) -> None:
    if reason is None:
        if seq.owner.each_event and seq.sample == 0 and seq.particle == 0:  # one per request and step
            outbox[target(seq.owner)].append(Progress(seq.owner.request.request_id, seq.position - 1))
    elif read is not None:  # the chosen particle
        outbox[target(seq.owner)].append(sample_result(seq, reason, read))


def sample_result(seq: Sequence, reason: str, read: SampleRead) -> SampleResult:
    """A finished row's whole sample."""
    tokens, logprobs, top = read
    return SampleResult(
        seq.owner.request.request_id,
        seq.sample,
        seq.start,
        tokens,
        logprobs,
        reason,
        seq.stopping.matched,
        top,
        _summary(seq),
        seq.owner.cached_tokens,
    )


def generation(output: RunnerOutput, token: int, i: int, seq: Sequence, reason: str | None) -> Generation:
    """A streamed row's token of this step (row i)."""
    request = seq.owner.request
    k, top, logprob = request.top_logprobs, None, None
    if k:
        assert output.top_ids is not None and output.top_values is not None  # a row asks: the runner drew them
        top = list(zip(output.top_ids[i][:k], output.top_values[i][:k]))
    if request.wants_logprobs:
        assert output.logprobs is not None  # likewise
        logprob = output.logprobs[i]
    return Generation(
        request.request_id,
        seq.sample,
        seq.position - 1,
        token,
        logprob,
        reason,
        seq.stopping.matched if reason else None,
        top,
        _summary(seq) if reason else None,
        seq.owner.cached_tokens if reason else 0,
    )


def _summary(seq: Sequence) -> ParticleSummary | None:
    return seq.group.summary if seq.group is not None else None
