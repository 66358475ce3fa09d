"""What one engine step hands to each request: built from the step's outcome before rows move.

A streamed request gets a Generation per token; a non-streamed one a
SampleResult per finished sample, read from the runner's buffers in one go.
A request with particles (server/engine/particles.py) streams no tokens, since
resampling can still replace them: it gets Progress while its particles
run, and each sample's chosen particle as a SampleResult once it finishes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from server.engine.runner import Drawn, ModelRunner
from server.engine.scheduler import CANCELLED, Sequence, StepOutcome
from server.engine.streams import DONE, Outbox
from server.engine.types import Generation, ParticleSummary, Progress, SampleResult


def step_events(rows: list[Sequence], outcome: StepOutcome, tokens: list[list[int]], drawn: Drawn,
                runner: ModelRunner) -> Outbox:
    """The step's events per request, DONE for each request that completed. tokens: each row's
    tokens since the last update (one when a client watches each step, as a streamed one does)."""
    outbox: Outbox = defaultdict(list)
    extras = _StepExtras.of(drawn)
    for i, (seq, reason) in enumerate(zip(rows, outcome.reasons)):
        stream = seq.owner
        if reason == CANCELLED:
            continue
        if seq.group is not None and seq.group.particles > 1:
            _particle_event(outbox, runner, i, seq, reason)
        elif stream.each_event:
            outbox[stream].append(extras.generation(i, seq, tokens[i][-1], reason))
        elif reason is not None:
            outbox[stream].append(sample_result(runner, i, seq, reason))
    for stream in outcome.completed:
        outbox[stream].append(DONE)
    return outbox


def _particle_event(outbox: Outbox, runner: ModelRunner, row: int, seq: Sequence, reason: str | None) -> None:
    if reason is None:
        if seq.owner.each_event and seq.sample == 0 and seq.particle == 0:  # one per request and step
            outbox[seq.owner].append(Progress(seq.owner.request.request_id, seq.position - 1))
    elif seq.particle == seq.group.chosen:
        outbox[seq.owner].append(sample_result(runner, row, seq, reason))


def sample_result(runner: ModelRunner, row: int, seq: Sequence, reason: str) -> SampleResult:
    """A finished row's whole sample."""
    request = seq.owner.request
    tokens, logprobs, top = runner.read_sample(row, seq.start, seq.position, request)
    return SampleResult(request.request_id, seq.sample, seq.start, tokens, logprobs, reason, seq.stopping.matched,
                        top, _summary(seq))


@dataclass
class _StepExtras:
    """A step's log-probabilities as host lists, read once for all streamed rows."""

    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_values: list[list[float]] | None

    @classmethod
    def of(cls, drawn: Drawn) -> "_StepExtras":
        def host(t):
            return t.tolist() if t is not None else None

        return cls(host(drawn.logprobs), host(drawn.top_ids), host(drawn.top_values))

    def generation(self, i: int, seq: Sequence, token: int, reason: str | None) -> Generation:
        request = seq.owner.request
        k = request.top_logprobs
        top = list(zip(self.top_ids[i][:k], self.top_values[i][:k])) if k else None
        return Generation(request.request_id, seq.sample, seq.position - 1, token,
                          self.logprobs[i] if request.wants_logprobs else None, reason,
                          seq.stopping.matched if reason else None, top, _summary(seq) if reason else None)


def _summary(seq: Sequence) -> ParticleSummary | None:
    return seq.group.summary if seq.group is not None else None
