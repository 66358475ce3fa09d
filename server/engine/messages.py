"""The messages between the API process and an engine process: one typed dataclass each, pickled over the pipe.

    API -> engine:  Submit  Cancel  Score  Stop
    engine -> API:  Started | StartFailed   Accepted | Refused   Scored   Step   Events   GaugesNow   Compiled

A pass's figures and its events travel in one `Step`, so the API process records the figures before it hands
the events on (a client that has its answer finds the step counted when it scrapes /metrics). A pass that hands
out no events keeps its figures back for the next message (server/engine/process.py's `PipeSink`): every message
wakes the API process, whose reader then runs beside the engine's step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.engine.output import Gauges
from server.engine.types import GenerationRequest, PromptScores, StepStats

ErrorDescription = tuple[str, str]  # (code, message): see process.describe_error
TaggedEvents = list[tuple[int, list[Any]]]  # (the API process's key of a stream, its events)


# -- API -> engine ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    key: int
    request: GenerationRequest
    each_event: bool


@dataclass(frozen=True, slots=True)
class Cancel:
    key: int


@dataclass(frozen=True, slots=True)
class Score:
    key: int
    tokens: list[int]
    top: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


# -- engine -> API ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Started:
    state_bytes_allocated: int
    cuda_graphs: bool
    cpu_route: str | None


@dataclass(frozen=True, slots=True)
class StartFailed:
    message: str


@dataclass(frozen=True, slots=True)
class Accepted:
    key: int
    gauges: Gauges  # the queue with the request in it: one message a submit, not two


@dataclass(frozen=True, slots=True)
class Refused:
    key: int
    error: ErrorDescription


@dataclass(frozen=True, slots=True)
class Scored:
    key: int
    result: PromptScores | None
    error: ErrorDescription | None


@dataclass(frozen=True, slots=True)
class Step:
    stats: list[StepStats]  # the figures of the passes since the last message, oldest first
    events: TaggedEvents


@dataclass(frozen=True, slots=True)
class Events:
    events: TaggedEvents


@dataclass(frozen=True, slots=True)
class GaugesNow:
    gauges: Gauges
    stats: list[StepStats] = field(default_factory=list)  # figures held back, recorded before the gauges


@dataclass(frozen=True, slots=True)
class Compiled:
    compiled: bool
    cpu_route: str | None
