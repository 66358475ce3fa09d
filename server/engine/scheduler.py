"""The host-only half of continuous batching: queue, admission, row map, slot budget.

Plain data: no threads, no tensors, so its rules are tested without an
engine. The engine calls it under a lock (submissions arrive from the event
loop) and hands it each pass's tokens (`update_from_output`); what it decides
for the slot tensors (which rows to prefill and copy, which samples to read,
which rows to move into freed slots) it returns as data the runner carries out.

Live sequences always occupy rows [0, n): when one finishes, the last live
row moves into its place, so a step runs the model on exactly the live rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Protocol

from model.decode.particles import ParticleGroup, Resampling, conclude, known_rows, particle_seed, weigh
from model.io.vocabulary import Vocabulary
from server.engine.step import (
    CANCELLED,
    RunnerOutput,
    SampleSpan,
    SchedulerOutput,
    StepNeeds,
    StepOutcome,
    StepUpdate,
)
from server.engine.stopping import StoppingCriteria
from server.engine.types import GenerationRequest, StepStats


class QueueFull(Exception):
    """The waiting queue is at its limit; the client should retry later (429)."""


class Submission(Protocol):
    """What the scheduler needs of a queued request (a GenerationStream in the engine)."""

    request: GenerationRequest
    cancelled: bool
    submitted_at: float  # time.monotonic() at submission
    first_token_at: float | None
    each_event: bool  # the client sees each token as it is drawn (streaming)
    cached_tokens: int  # prompt tokens its prefill took from the prefix cache


@dataclass(slots=True)
class Sequence:
    """One live sequence (one sample of a request) in one row of the batch."""

    owner: Submission
    sample: int  # which of the request's n samples
    position: int  # absolute position of the next token to draw
    stopping: StoppingCriteria
    last_token_at: float = 0.0
    particle: int = 0  # which of the sample's particles (model/decode/particles.py)
    log_weight: float = 0.0  # the particle's weight since the last resampling, log
    group: ParticleGroup | None = None  # what the sample's particles share; None: no weights kept

    @property
    def start(self) -> int:
        """Position of the sample's first generated token."""
        return len(self.owner.request.prompt)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new sequence goes: its row, and the row to copy it from (None: the prefill wrote it)."""

    row: int
    owner: Submission
    sample: int
    copy_of: int | None
    particle: int = 0

    @property
    def seed(self) -> int:
        """The seed the row draws with: seed + sample, or one of its particles' own."""
        return particle_seed(self.owner.request.sampling.seed + self.sample, self.particle)


class Scheduler:
    def __init__(self, max_batch: int, max_waiting: int, vocabulary: Vocabulary | None = None):
        """vocabulary: a text model's (its tokens' bytes are what stop sequences match); None: bytes."""
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.pieces = vocabulary.pieces if vocabulary is not None and not vocabulary.is_bytes else None
        self.eos = vocabulary.eos if vocabulary is not None else None
        self.waiting: deque[Submission] = deque()
        self.rows: list[Sequence] = []
        self.admitting = 0  # sequences taken off the queue whose rows are not registered yet
        self._live: dict[Submission, int] = {}  # rows still decoding per request
        self._needs: StepNeeds | None = None  # of the live requests; None when they changed

    # -- budget ---------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def waiting_sequences(self) -> int:
        """Sequences queued: a request waits for a slot per particle of each of its n samples."""
        return sum(s.request.rows for s in list(self.waiting))

    def free_slots(self) -> int:
        """Slots neither running, nor promised to a queued request, nor being admitted."""
        return max(0, self.max_batch - self.running - self.waiting_sequences - self.admitting)

    # -- queue ----------------------------------------------------------------
    def add(self, submission: Submission) -> None:
        """Queue a request, unless the queue is full and no free slot could take it at once."""
        self.drop_cancelled()
        if len(self.waiting) >= self.max_waiting and submission.request.rows > self.free_slots():
            raise QueueFull(f"{len(self.waiting)} requests are waiting, the limit; retry later")
        self.waiting.append(submission)

    def drop_cancelled(self) -> list[Submission]:
        """Remove and return requests whose clients left while queued."""
        gone = [s for s in self.waiting if s.cancelled]
        for submission in gone:
            self.waiting.remove(submission)
        return gone

    def take_waiting(self) -> list[Submission]:
        """Empty the queue (shutting down): the requests that were in it."""
        taken = list(self.waiting)
        self.waiting.clear()
        return taken

    def admissible(self) -> list[Submission]:
        """The waiting requests the next admission takes: in order, while they fit."""
        fitting, free = [], self.max_batch - len(self.rows)
        for submission in self.waiting:
            if (free := free - submission.request.rows) < 0:
                break
            fitting.append(submission)
        return fitting

    def take_admissible(self) -> list[Submission]:
        """Take every waiting request that fits, in order; they count as admitting until `admitted`."""
        taken = self.admissible()
        for _ in taken:
            self.waiting.popleft()
        self.admitting = sum(s.request.rows for s in taken)
        return taken

    def admitted(self) -> None:
        """The taken requests are registered, or failed: they no longer count as admitting."""
        self.admitting = 0

    # -- rows -----------------------------------------------------------------
    def placements(self, group: Sequence_[Submission]) -> list[Placement]:
        """Rows for a group prefilled together: one per request first (the prefill writes them),
        then the rest of each request's rows (further samples, particles), copied from its first."""
        first = len(self.rows)
        places = [Placement(first + i, s, 0, None) for i, s in enumerate(group)]
        for i, submission in enumerate(group):
            per_sample = submission.request.particles or 1
            for r in range(1, submission.request.rows):
                places.append(Placement(first + len(places), submission, r // per_sample, first + i, r % per_sample))
        return places

    def register(self, places: list[Placement], prompt_log_likelihood: dict[Submission, float] | None = None) -> None:
        """The rows of `places` are written: they decode from the next step on. A weighed request's
        samples start their likelihood estimate at their prompt's (`prompt_log_likelihood`)."""
        groups: dict[tuple[Submission, int], ParticleGroup] = {}
        for place in places:
            req = place.owner.request
            stopping = self.stopping(req)
            seq = Sequence(place.owner, place.sample, len(req.prompt), stopping, particle=place.particle)
            if req.particles is not None:
                seq.group = groups.setdefault(
                    (place.owner, place.sample),
                    ParticleGroup(
                        req.sampling.seed + place.sample,
                        req.particles,
                        (prompt_log_likelihood or {}).get(place.owner, 0.0),
                    ),
                )
            self.rows.append(seq)
            self._live[place.owner] = req.rows
        self._needs = None

    def stopping(self, req: GenerationRequest) -> StoppingCriteria:
        """What ends one sample of `req`."""
        p = req.sampling
        eos = None if p.ignore_eos else self.eos
        return StoppingCriteria(
            tuple(req.stop), req.max_new_tokens, self.pieces, eos, frozenset(p.stop_token_ids), p.min_tokens
        )

    def steps_ahead(self, limit: int) -> int:
        """Steps the live rows can run before the scheduler must look again (at most `limit`): one
        while a client sees every step, else as many as every row has tokens left to draw."""
        if limit <= 1 or not self.rows or self.needs().each_step:
            return 1
        left = min(seq.stopping.max_new_tokens - seq.stopping.generated for seq in self.rows)
        return max(1, min(limit, left))

    def schedule(self, limit: int) -> SchedulerOutput:
        """The next pass: the live rows, how many steps they may run (at most `limit`), what they need."""
        needs = self.needs()
        return SchedulerOutput(
            self.running, self.steps_ahead(limit), needs, known_rows(self.rows) if needs.weigh else []
        )

    def update_from_output(self, plan: SchedulerOutput, output: RunnerOutput) -> StepUpdate:
        """A pass's tokens: weigh the particles at their known tokens (resampling where they must), advance every
        row (`advance`), then let finished rows leave (`compact`). What the runner must do about it comes back as
        data, with the rows as they were before they moved (for the events)."""
        resampling = weigh(self.rows, plan.known, output.known_logprobs) if plan.known else Resampling([], 0)
        tokens = list(output.tokens)  # the runner's lists stay as drawn: a copy takes its source's tokens here
        for copy in resampling.copies:
            tokens[copy.dst] = list(tokens[copy.src])
        outcome = self.advance(tokens, output.ended, output.started)
        rows, reads = tuple(self.rows), sample_reads(self.rows, outcome)
        moves = self.compact(outcome.finished)
        stats = self.make_stats(outcome, 0, resampling.samples, len(tokens[0]) if tokens else 1)
        return StepUpdate(rows, tokens, outcome, resampling.copies, reads, moves, self.running, stats)

    def advance(self, tokens: list[list[int]], now: float, started: float | None = None) -> StepOutcome:
        """Advance every row by the tokens it drew since the last update (one per step, the steps run
        from `started` to `now`); rows that finish (their later tokens are dropped) or were cancelled leave."""
        outcome, started = StepOutcome([None] * len(self.rows)), now if started is None else started
        for i, seq in enumerate(self.rows):
            reason = CANCELLED if seq.owner.cancelled else _advance(seq, tokens[i], now, started, outcome)
            if reason is not None:
                outcome.reasons[i] = reason
                outcome.finished.append(i)
        self._conclude_particles(outcome.finished)
        for i in outcome.finished:
            owner = self.rows[i].owner
            self._live[owner] -= 1
            if self._live[owner] == 0:
                del self._live[owner]
                outcome.completed.append(owner)
                self._needs = None
        return outcome

    def _conclude_particles(self, finished: list[int]) -> None:
        """Samples whose particles finished draw their answer (a sample's particles finish together)."""
        groups: dict[ParticleGroup, list[Sequence]] = {}
        for i in finished:
            group = self.rows[i].group
            if group is not None:
                groups.setdefault(group, []).append(self.rows[i])
        for group, particles in groups.items():
            conclude(group, particles)

    def compact(self, finished: list[int]) -> list[tuple[int, int]]:
        """Remove finished rows, moving the last live row into each hole. Returns (src, dst) pairs with every
        source past the rows left and every destination among them, so the runner copies them all at once."""
        origin: dict[int, int] = {}  # row -> the row its sequence was in before this compaction
        for i in sorted(finished, reverse=True):
            last = len(self.rows) - 1
            if i != last:
                origin[i] = origin.pop(last, last)  # a row moved twice comes from where it first was
                self.rows[i] = self.rows[last]
            self.rows.pop()
        return sorted((src, dst) for dst, src in origin.items())

    def clear_rows(self) -> list[Submission]:
        """Drop every row (a failed step); the requests they belonged to."""
        owners = list(dict.fromkeys(seq.owner for seq in self.rows))
        self.rows.clear()
        self._live.clear()
        self._needs = None
        return owners

    def needs(self) -> StepNeeds:
        """What the live requests ask of the next step (recomputed only when they change)."""
        if self._needs is None:
            self._needs = StepNeeds.of(self._live)
        return self._needs

    def make_stats(
        self, outcome: StepOutcome, state_bytes: int, resamplings: int = 0, steps: int = 1, seconds: float = 0.0
    ) -> StepStats:
        """The figures of the `steps` steps since the last update (which took `seconds`) for the metrics,
        once finished rows have left."""
        return StepStats(
            batch=len(outcome.reasons),
            steps=steps,
            tokens=outcome.tokens,
            running=self.running,
            waiting=self.waiting_sequences,
            state_bytes=state_bytes,
            first_token_seconds=outcome.first_token_seconds,
            token_gaps=outcome.token_gaps,
            resamplings=resamplings,
            seconds=seconds,
        )


def sample_reads(rows: list[Sequence], outcome: StepOutcome) -> dict[int, SampleSpan]:
    """The finished rows whose whole sample goes out, for the runner to read: a non-streamed request's, and the
    chosen particle of each sample that runs several."""
    reads = {}
    for i in outcome.finished:
        seq, group = rows[i], rows[i].group
        if outcome.reasons[i] == CANCELLED:
            continue
        several = group is not None and group.particles > 1
        if seq.particle == group.chosen if group is not None and several else not seq.owner.each_event:
            reads[i] = SampleSpan(seq.start, seq.position, seq.owner.request)
    return reads


def _advance(seq: Sequence, tokens: list[int], now: float, started: float, outcome: StepOutcome) -> str | None:
    """Push a row's tokens until one ends it; its finish reason, or None."""
    reason, taken = seq.stopping.push_run(tokens)
    seq.position += taken
    outcome.tokens += taken
    _time_tokens(seq, taken, now, started, outcome)
    return reason


def _time_tokens(seq: Sequence, count: int, now: float, started: float, outcome: StepOutcome) -> None:
    """A request's first token times its wait. The `count` tokens a sequence kept since its previous
    update (or since `started`, the update's first step, for a new sequence, whose first token is no
    gap) share out that time, so a step's inter-token gaps take one or two histogram updates."""
    owner, new = seq.owner, not seq.last_token_at
    if owner.first_token_at is None:
        owner.first_token_at = now
        outcome.first_token_seconds.append(now - owner.submitted_at)
    gaps = count - 1 if new else count
    if gaps > 0:
        gap = (now - (started if new else seq.last_token_at)) / count
        outcome.token_gaps[gap] = outcome.token_gaps.get(gap, 0) + gaps
    seq.last_token_at = now
