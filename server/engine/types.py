"""Typed objects passed between the engine and the HTTP handlers."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.decode.particles import ParticleSummary as ParticleSummary  # re-exported: events carry it
from model.decode.sampling import SamplingParams


@dataclass
class GenerationRequest:
    """One prompt to extend, possibly into n samples.

    `prompt` holds the tokens known before the first one to generate (text
    bytes, or pixels before the first unknown one). `forced` maps absolute
    positions after the prompt to tokens that must be kept (known pixels
    after the first unknown one). Sample i draws with seed `sampling.seed + i`.
    """

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    forced: dict[int, int] = field(default_factory=dict)
    stop: list[bytes] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0  # also the this many most likely tokens per position (implies logprobs)
    # Sequential Monte Carlo (model/decode/particles.py): each sample runs this many particles, weighted by the
    # known tokens in `forced`. None: no weights kept (text); 1: forced sampling, with the likelihood estimate.
    particles: int | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def rows(self) -> int:
        """Decode slots the request holds while it runs: a row per particle of each sample."""
        return self.n * (self.particles or 1)

    @property
    def weighs_known(self) -> bool:
        """Whether its particles take weights from known tokens after the prompt."""
        return self.particles is not None and bool(self.forced)

    @property
    def steps_each(self) -> bool:
        """Whether the engine must look after every step: weights to take at known tokens, or several
        particles to conclude together. One particle with nothing to weigh (an image whose known pixels
        all come first) is a plain sample and may run several steps at once."""
        return self.weighs_known or (self.particles or 1) > 1


TopLogprobs = list[tuple[int, float]]  # (token, log-probability), most likely first


@dataclass(slots=True)  # not frozen: a frozen __init__ is slower, and the engine makes one per row per step
class Generation:
    """One generated token of one sample, as the engine emits it. Read-only by convention."""

    request_id: str
    sample: int  # which of the n samples
    position: int  # absolute position of the token in the sequence
    token: int
    logprob: float | None
    finish_reason: str | None = None  # "length", "stop", or None while running
    matched_stop: bytes | None = None  # the stop sequence that ended the sample (finish_reason "stop")
    top_logprobs: TopLogprobs | None = None  # when the request asks for them
    particles: ParticleSummary | None = None  # on a sample's last token, for requests with particles
    cached_tokens: int = 0  # on a sample's last token: prompt tokens the prefix cache gave (not prefilled)


@dataclass(frozen=True, slots=True)
class Progress:
    """A streamed request with particles has reached `position`: its tokens come once they are fixed."""

    request_id: str
    position: int  # absolute position of the token just drawn


@dataclass(slots=True)
class SampleResult:
    """One whole sample of a non-streamed request, handed over once it has finished:
    the engine keeps its tokens in a device buffer meanwhile, with no per-token event."""

    request_id: str
    sample: int  # which of the n samples
    start: int  # absolute position of tokens[0]
    tokens: list[int]
    logprobs: list[float] | None  # one per token when asked for
    finish_reason: str  # "length" or "stop"
    matched_stop: bytes | None = None  # the stop sequence that ended the sample (finish_reason "stop")
    top_logprobs: list[TopLogprobs] | None = None  # one list per token when asked for
    particles: ParticleSummary | None = None  # for requests with particles
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (not prefilled)


@dataclass
class PromptScores:
    """A prompt scored in one parallel pass: each token's log-probability given those before it (None for a first
    token nothing predicts: a model that reads no start token before its prompt)."""

    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None] | None = None  # the most likely tokens at each position, when asked


@dataclass(frozen=True)
class GenerationError:
    """The engine failed a request; the handler turns this into a 5xx."""

    request_id: str
    message: str
    code: str = "engine_error"  # what the client is told (server/api/engine_calls.py: engine_error)


@dataclass(slots=True)
class StepStats:
    """What one engine update (one step, or several run at once) did, for the metrics: recorded in one place."""

    batch: int  # sequences that drew tokens
    steps: int  # decode steps run (several at once when no client watches each: multi-step)
    tokens: int  # tokens drawn
    running: int  # sequences still decoding after the step
    waiting: int  # sequences queued
    state_bytes: int  # decode-state bytes held by the running sequences
    first_token_seconds: list[float] = field(default_factory=list)  # submission -> first token, per new sequence
    token_gaps: dict[float, int] = field(default_factory=dict)  # seconds since a sequence's previous token -> count
    resamplings: int = 0  # particle resamplings the step made
    seconds: float = (
        0.0  # wall time of the update's steps: draws, forwards (the previous update's closing one) and bookkeeping
    )
    prefix_queried: int = 0  # tokens looked up in the prefix cache since the last pass
    prefix_hit: int = 0  # of those, tokens found cached
    prefix_bytes: int | None = None  # bytes the prefix cache holds (None: no cache)
    prefix_entries: int | None = None  # states it holds
