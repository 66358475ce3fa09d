"""What one engine step hands to each request: built from the step's outcome before rows move.

A streamed request gets a Generation per token; a non-streamed one a
SampleResult per finished sample, which the runner read for it in one go.
A request with particles (model/particles.py) streams no tokens, since
resampling can still replace them: it gets Progress while its particles
run, and each sample's chosen particle as a SampleResult once it finishes.
"""

from __future__ import annotations

from collections import defaultdict

from server.engine.scheduler import Sequence
from server.engine.step import CANCELLED, RunnerOutput, SampleRead, StepOutcome
from server.engine.streams import DONE, Outbox
from server.engine.types import Generation, GenerationRequest, ParticleSummary, Progress, SampleResult


def sample_reads(rows: list[Sequence], outcome: StepOutcome) -> dict[int, tuple[int, int, GenerationRequest]]:
    """The finished rows whose whole sample goes out (row -> (start, end, request), for the runner to read): a
    non-streamed request's, and the chosen particle of each sample that runs several."""
    reads = {}
    for i in outcome.finished:
        seq, reason = rows[i], outcome.reasons[i]
        several = seq.group is not None and seq.group.particles > 1
        if reason != CANCELLED and (seq.particle == seq.group.chosen if several else not seq.owner.each_event):
            reads[i] = (seq.start, seq.position, seq.owner.request)
    return reads


def step_events(
    rows: list[Sequence], outcome: StepOutcome, output: RunnerOutput, samples: dict[int, SampleRead]
) -> Outbox:
    """The step's events per request, DONE for each request that completed. `samples`: what the runner read
    of the rows `sample_reads` named. A pure function of the step's data: rows have not moved yet."""
    outbox: Outbox = defaultdict(list)
    for i, (seq, reason) in enumerate(zip(rows, outcome.reasons)):
        stream = seq.owner
        if reason == CANCELLED:
            continue
        if seq.group is not None and seq.group.particles > 1:
            _particle_event(outbox, seq, reason, samples.get(i))
        elif stream.each_event:
            outbox[stream].append(generation(output, i, seq, reason))
        elif reason is not None:
            outbox[stream].append(sample_result(seq, reason, samples[i]))
    for stream in outcome.completed:
        outbox[stream].append(DONE)
    return outbox


def _particle_event(outbox: Outbox, seq: Sequence, reason: str | None, read: SampleRead | None) -> None:
    if reason is None:
        if seq.owner.each_event and seq.sample == 0 and seq.particle == 0:  # one per request and step
            outbox[seq.owner].append(Progress(seq.owner.request.request_id, seq.position - 1))
    elif read is not None:  # the chosen particle
        outbox[seq.owner].append(sample_result(seq, reason, read))


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
    )


def generation(output: RunnerOutput, i: int, seq: Sequence, reason: str | None) -> Generation:
    """A streamed row's token of this step."""
    request = seq.owner.request
    k = request.top_logprobs
    top = list(zip(output.top_ids[i][:k], output.top_values[i][:k])) if k else None
    return Generation(
        request.request_id,
        seq.sample,
        seq.position - 1,
        output.tokens[i][-1],
        output.logprobs[i] if request.wants_logprobs else None,
        reason,
        seq.stopping.matched if reason else None,
        top,
        _summary(seq) if reason else None,
    )


def _summary(seq: Sequence) -> ParticleSummary | None:
    return seq.group.summary if seq.group is not None else None
