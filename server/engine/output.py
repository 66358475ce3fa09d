"""Where an engine hands what it produced: one interface, two ends.

The engine never records a metric itself. It hands each pass's `StepStats` together with the pass's events, and
its queue gauges, to its `EngineOutput`; the API side records the figures from them where the events arrive, so
a client that has its answer finds the step counted when it scrapes /metrics. `LocalOutput` is that API side for
an engine on a thread of the API process; an engine process's output (server/engine/process.py) sends the same
data over its pipe, one message a pass (the pass's figures and events together), and the `EngineClient` (server/engine/client.py) records it on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from server.engine.streams import Outbox, deliver
from server.engine.types import StepStats

if TYPE_CHECKING:
    from model.transformer import Transformer
    from server.metrics import Metrics, ModelMetrics


@dataclass(frozen=True)
class Gauges:
    """The queue's gauges outside a step: after a submit, while idle, and the state allocated at start."""

    running: int
    waiting: int
    idle: bool = False  # nothing runs: the batch is empty and the rate windows slide on
    state_allocated: int | None = None  # bytes of all slots' state, known once started


class EngineOutput(Protocol):
    """What an engine hands out. `metrics`: the model's series its handlers record into (None: no metrics, or
    kept by another process)."""

    metrics: ModelMetrics | None

    def step(self, stats: StepStats, outbox: Outbox) -> None:
        """A pass: its figures, then its events. (Events outside a pass, as `streams.finish` sends them, go
        straight to their streams' sinks.)"""

    def gauges(self, gauges: Gauges) -> None: ...


def record_gauges(metrics: ModelMetrics, gauges: Gauges) -> None:
    if gauges.state_allocated is not None:
        metrics.state_allocated(gauges.state_allocated)
    if gauges.idle:
        metrics.idle(gauges.waiting)
    else:
        metrics.queue(gauges.running, gauges.waiting)


class LocalOutput:
    """An engine on a thread of the API process: figures recorded into `metrics` (unless None), events handed to
    their streams' event loops."""

    def __init__(self, metrics: ModelMetrics | None = None):
        self.metrics = metrics

    @classmethod
    def recording(cls, metrics: Metrics, name: str, model: Transformer) -> "LocalOutput":
        """Recording into `metrics`' series for the model `name`."""
        return cls(metrics.for_model(name, model.config.attention, images=model.config.task == "mnist"))

    def step(self, stats: StepStats, outbox: Outbox) -> None:
        if self.metrics is not None:
            self.metrics.record_step(stats)
        deliver(outbox)

    def gauges(self, gauges: Gauges) -> None:
        if self.metrics is not None:
            record_gauges(self.metrics, gauges)
