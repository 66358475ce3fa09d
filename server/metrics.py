"""Prometheus metrics, one registry per app (no global default registry).

Every name starts with `rnnserve_` and carries its unit. Per-model series
are labelled `model` and `attention`.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from server.engine.types import StepStats

MODEL_LABELS = ("model", "attention")
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW_SECONDS = 10.0


class RateWindow:
    """Events per second over the last `window` seconds (thread-safe)."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS):
        self.window = window
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0
        self._lock = threading.Lock()

    def add(self, amount: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, amount))
            self._total += amount  # a running total: the engine adds once per step
            while self._events and self._events[0][0] < now - self.window:
                self._total -= self._events.popleft()[1]
            return self._total / self.window


class CountedHistogram:
    """A Prometheus histogram fed one value observed n times in one call.

    All rows of a decoding step share one inter-token gap (the time since the
    previous step), so the engine records a step as one update instead of an
    observe per row (benchmarks/results/NOTES.md, "Measurements behind design choices").
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ):
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.bounds = [*buckets, float("inf")]
        self._series: dict[tuple[str, ...], list] = {}  # labels -> [per-bucket counts, sum]
        self._lock = threading.Lock()
        registry.register(self)

    def add_series(self, labels: tuple[str, ...]) -> None:
        """Expose the series of `labels` at zero before anything is observed."""
        with self._lock:
            self._series_of(labels)

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        with self._lock:
            series = self._series_of(labels)
            series[0][bisect.bisect_left(self.bounds, value)] += count  # first bucket with value <= le
            series[1] += value * count

    def _series_of(self, labels: tuple[str, ...]) -> list:
        """[per-bucket counts, sum] of `labels`, created at zero if new (call with the lock held)."""
        return self._series.setdefault(labels, [[0] * len(self.bounds), 0.0])

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            series = [(labels, list(counts), total) for labels, (counts, total) in self._series.items()]
        for labels, counts, total in series:
            cumulative, buckets = 0, []
            for bound, n in zip(self.bounds, counts):
                cumulative += n
                buckets.append(
                    (floatToGoString(bound), cumulative)
                )  # "+Inf", "1e+06": as prometheus_client writes them
            family.add_metric(list(labels), buckets, total)
        yield family

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]


class PrometheusSeries:
    """Where `Metrics` keeps its series by default: a prometheus_client registry, served at /metrics.

    Any other store (ray_metrics.RaySeries under Ray Serve) offers the same four
    constructors; what they return is used through `labels(*values)` and the
    child's inc / set / observe, and the counted histogram's observe / add_series.
    """

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def counter(self, name: str, documentation: str, labels: tuple[str, ...]):
        return Counter(name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: tuple[str, ...]):
        return Gauge(name, documentation, labels, registry=self.registry)

    def histogram(self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]):
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def counted_histogram(self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]):
        return CountedHistogram(name, documentation, labels, buckets, self.registry)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, series=None):
        self.registry = registry or CollectorRegistry()
        s = series or PrometheusSeries(self.registry)
        self._declare_request_series(s)
        self._declare_engine_series(s)
        self._declare_rate_and_state_series(s)
        self._token_rates: dict[tuple[str, str], RateWindow] = {}
        self._image_rates: dict[tuple[str, str], RateWindow] = {}
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}
        # A gauge of a model served by several engine workers (server/engine/pool.py) is the sum of theirs.
        self._worker_values: dict[tuple[int, tuple[str, ...]], dict[int, float]] = {}
        self._summing = threading.Lock()  # workers' reader threads set one gauge: the last sum set is the newest

    def _declare_request_series(self, s) -> None:
        self.generated_tokens = s.counter(
            "rnnserve_generated_tokens", "Tokens generated (pixels or bytes).", MODEL_LABELS
        )
        self.completed_images = s.counter("rnnserve_completed_images", "Image completions finished.", MODEL_LABELS)
        self.resamplings = s.counter(
            "rnnserve_particle_resamplings",
            "Resamplings of image completions' particles "
            "(sequential Monte Carlo), each a set of decode-state row copies.",
            MODEL_LABELS,
        )
        self.requests = s.counter(
            "rnnserve_requests",
            "HTTP requests by endpoint, outcome, and the model they named (none: no model).",
            ("endpoint", "outcome", *MODEL_LABELS),
        )
        self.ttft = s.histogram(
            "rnnserve_time_to_first_token_seconds",
            "Time from submission to a sequence's first generated token.",
            MODEL_LABELS,
            LATENCY_BUCKETS,
        )
        self.itl = s.counted_histogram(
            "rnnserve_inter_token_latency_seconds",
            "Time between two tokens of one sequence.",
            MODEL_LABELS,
            LATENCY_BUCKETS,
        )
        self.latency = s.histogram(
            "rnnserve_request_latency_seconds", "End-to-end generation request latency.", MODEL_LABELS, LATENCY_BUCKETS
        )

    def _declare_engine_series(self, s) -> None:
        self.running = s.gauge("rnnserve_running_sequences", "Sequences holding a decode slot.", MODEL_LABELS)
        self.waiting = s.gauge("rnnserve_waiting_sequences", "Sequences queued for a slot.", MODEL_LABELS)
        self.batch_size = s.gauge(
            "rnnserve_batch_size", "Sequences in the last decoding step (of each engine worker, summed).", MODEL_LABELS
        )
        self.decode_steps = s.counter("rnnserve_decode_steps", "Batched decoding steps run.", MODEL_LABELS)
        self.step_time = s.counted_histogram(
            "rnnserve_decode_step_seconds",
            "Wall time of one batched decoding step, sampling and bookkeeping included "
            "(steps run as one multi-step pass share its time); the rate of its _sum is the share of time the engine "
            "spends decoding.",
            MODEL_LABELS,
            STEP_BUCKETS,
        )

    def _declare_rate_and_state_series(self, s) -> None:
        self.tokens_per_second = s.gauge(
            "rnnserve_tokens_per_second",
            f"Tokens generated per second over the last {RATE_WINDOW_SECONDS:g} s.",
            MODEL_LABELS,
        )
        self.images_per_second = s.gauge(
            "rnnserve_images_per_second",
            f"Images completed per second over the last {RATE_WINDOW_SECONDS:g} s.",
            MODEL_LABELS,
        )
        self.state_in_use = s.gauge(
            "rnnserve_decode_state_in_use_bytes",
            "Bytes of decode state holding the live sequences at their current lengths.",
            MODEL_LABELS,
        )
        self.state_allocated = s.gauge(
            "rnnserve_decode_state_allocated_bytes",
            "Bytes of decode state preallocated for all slots (--max-batch sequences at max_len per engine worker).",
            MODEL_LABELS,
        )
        self.engine_restarts = s.counter(
            "rnnserve_engine_restarts", "Engine processes started again after one died.", MODEL_LABELS
        )
        self._declare_prefix_cache_series(s)

    def _declare_prefix_cache_series(self, s) -> None:
        self.prefix_queried = s.counter(
            "rnnserve_prefix_cache_queried_tokens",
            "Tokens (start token and prompt) looked up in the prefix cache of decode states.",
            MODEL_LABELS,
        )
        self.prefix_hit = s.counter(
            "rnnserve_prefix_cache_hit_tokens",
            "Of the tokens looked up in the prefix cache, those whose state it held (not prefilled again).",
            MODEL_LABELS,
        )
        self.prefix_bytes = s.gauge(
            "rnnserve_prefix_cache_bytes", "Bytes of decode states the prefix cache holds.", MODEL_LABELS
        )
        self.prefix_entries = s.gauge(
            "rnnserve_prefix_cache_entries", "Decode states (prefixes) the prefix cache holds.", MODEL_LABELS
        )

    def _bound(self, metric, *labels: str):
        """metric.labels(*labels), memoised: the lookup costs more than an observe, and the
        engine records a latency for every row at every step."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _set(self, metric, labels: tuple[str, ...], value: float, worker: int = 0) -> None:
        """Set a model's gauge to the sum over its engine workers, `value` being `worker`'s part."""
        with self._summing:
            parts = self._worker_values.setdefault((id(metric), labels), {})
            parts[worker] = value
            self._bound(metric, *labels).set(sum(parts.values()))

    # -- engine side -------------------------------------------------------
    def step(
        self,
        model: str,
        attention: str,
        batch: int,
        tokens: int,
        state_bytes: int,
        steps: int = 1,
        seconds: float = 0.0,
        worker: int = 0,
    ) -> None:
        """Record `steps` decoding steps of `batch` sequences producing `tokens` tokens in `seconds`."""
        labels = (model, attention)
        self._bound(self.decode_steps, *labels).inc(steps)
        self.step_time.observe(labels, seconds / steps, steps)  # an update runs at least one step
        self._set(self.batch_size, labels, batch, worker)
        self._set(self.state_in_use, labels, state_bytes, worker)
        self.tokens(model, attention, tokens)

    def tokens(self, model: str, attention: str, n: int) -> None:
        labels = (model, attention)
        self._bound(self.generated_tokens, *labels).inc(n)
        rate = self._token_rates.setdefault(labels, RateWindow()).add(n)
        self._bound(self.tokens_per_second, *labels).set(rate)

    def idle(self, model: str, attention: str, images: bool, worker: int = 0) -> None:
        """No sequence is running (on `worker`): the batch is empty and the windows slide on."""
        self._set(self.batch_size, (model, attention), 0, worker)
        self._set(self.state_in_use, (model, attention), 0, worker)
        self.tokens(model, attention, 0)
        if images:
            self.images_completed(model, attention, 0)

    def queue(self, model: str, attention: str, running: int, waiting: int, worker: int = 0) -> None:
        self._set(self.running, (model, attention), running, worker)
        self._set(self.waiting, (model, attention), waiting, worker)

    def first_token(self, model: str, attention: str, seconds: float) -> None:
        self._bound(self.ttft, model, attention).observe(seconds)

    def inter_tokens(self, model: str, attention: str, seconds: float, sequences: int) -> None:
        """`sequences` sequences each got a token `seconds` after their previous one."""
        self.itl.observe((model, attention), seconds, sequences)

    # -- handler side ------------------------------------------------------
    def request(self, endpoint: str, outcome: str, model: str = "none", attention: str = "none") -> None:
        self._bound(self.requests, endpoint, outcome, model, attention).inc()

    def observe_request_latency(self, model: str, attention: str, seconds: float) -> None:
        self._bound(self.latency, model, attention).observe(seconds)

    def images_completed(self, model: str, attention: str, n: int) -> None:
        labels = (model, attention)
        self._bound(self.completed_images, *labels).inc(n)
        rate = self._image_rates.setdefault(labels, RateWindow()).add(n)
        self._bound(self.images_per_second, *labels).set(rate)

    def register_model(self, model: str, attention: str, images: bool) -> None:
        """Create a model's series at zero so dashboards see them before traffic (image series for image models only)."""
        labels = (model, attention)
        for metric in (
            self.generated_tokens,
            self.decode_steps,
            self.engine_restarts,
            self.prefix_queried,
            self.prefix_hit,
        ) + ((self.completed_images, self.resamplings) if images else ()):
            self._bound(metric, *labels).inc(0)
        gauges = (
            self.running,
            self.waiting,
            self.batch_size,
            self.tokens_per_second,
            self.state_in_use,
            self.state_allocated,
            self.prefix_bytes,
            self.prefix_entries,
        )
        for metric in gauges + ((self.images_per_second,) if images else ()):
            self._bound(metric, *labels).set(0)
        for metric in (self.ttft, self.latency):
            self._bound(metric, *labels)
        self.itl.add_series(labels)
        self.step_time.add_series(labels)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def for_model(self, model: str, attention: str, images: bool, worker: int = 0) -> "ModelMetrics":
        """One model's series with its labels bound, created at zero; `images`: an image model; `worker`: which
        of the model's engine workers records its gauges through it."""
        self.register_model(model, attention, images)
        return ModelMetrics(self, model, attention, images, worker)


class ModelMetrics:
    """One model's series, labels bound once: what its engine and handlers record."""

    def __init__(self, metrics: Metrics, model: str, attention: str, images: bool, worker: int = 0):
        self.metrics = metrics
        self.labels = (model, attention)
        self.images = images
        self.worker = worker
        self._allocated = 0  # bytes: set again while idle (see `idle`)

    def record_step(self, stats: StepStats) -> None:
        """Everything one decoding step changes, in one place."""
        m, labels = self.metrics, self.labels
        m.step(
            *labels,
            batch=stats.batch,
            tokens=stats.tokens,
            state_bytes=stats.state_bytes,
            steps=stats.steps,
            seconds=stats.seconds,
            worker=self.worker,
        )
        m.queue(*labels, stats.running, stats.waiting, self.worker)
        for seconds in stats.first_token_seconds:
            m.first_token(*labels, seconds)
        for gap, count in stats.token_gaps.items():
            m.inter_tokens(*labels, gap, count)
        if stats.resamplings:
            m._bound(m.resamplings, *labels).inc(stats.resamplings)
        if stats.prefix_bytes is not None:
            self.prefix_cache(stats)

    def prefix_cache(self, stats: StepStats) -> None:
        """The prefix cache's tokens looked up and found since the last step, and what it holds."""
        m, labels = self.metrics, self.labels
        m._bound(m.prefix_queried, *labels).inc(stats.prefix_queried)
        m._bound(m.prefix_hit, *labels).inc(stats.prefix_hit)
        m._set(m.prefix_bytes, labels, stats.prefix_bytes or 0, self.worker)
        m._set(m.prefix_entries, labels, stats.prefix_entries or 0, self.worker)

    def idle(self, waiting: int) -> None:
        """Nothing is running: the batch is empty and the rate windows slide on. The allocated state is set
        again too: it changes only at start-up, and Ray's export drops a value recorded before its metrics
        agent was up, so a gauge set once there could stay missing from it."""
        self.metrics.idle(*self.labels, self.images, self.worker)
        self.metrics.queue(*self.labels, 0, waiting, self.worker)
        self.state_allocated(self._allocated)

    def queue(self, running: int, waiting: int) -> None:
        self.metrics.queue(*self.labels, running, waiting, self.worker)

    def state_allocated(self, nbytes: int) -> None:
        self._allocated = nbytes
        self.metrics._set(self.metrics.state_allocated, self.labels, nbytes, self.worker)

    def engine_gone(self) -> None:
        """The engine died: nothing runs, waits or holds state until it is back."""
        self.idle(0)
        self.state_allocated(0)

    def engine_restarted(self) -> None:
        self.metrics._bound(self.metrics.engine_restarts, *self.labels).inc()

    def request_latency(self, seconds: float) -> None:
        self.metrics.observe_request_latency(*self.labels, seconds)

    def images_completed(self, n: int) -> None:
        self.metrics.images_completed(*self.labels, n)
