"""The metrics layer's series under Ray Serve: written through `ray.serve.metrics`.

`Metrics(series=RaySeries())` records exactly what it records standalone, but
each counter, gauge and histogram is a Ray metric of the same type and name.
Ray adds the `deployment`, `replica` and `application` tags and exports every
replica's series on its node's metrics port, named with a `ray_` prefix:
`rnnserve_generated_tokens_total` becomes `ray_rnnserve_generated_tokens_total`,
`rnnserve_time_to_first_token_seconds_bucket` becomes
`ray_rnnserve_time_to_first_token_seconds_bucket`, and so on. Nothing is kept
in the replica's own registry, so its /metrics has nothing to show
(`ray_app` answers it with a pointer to Ray's export instead).
"""

from __future__ import annotations

from typing import Callable

from ray.serve import metrics as serve_metrics


class _Child:
    """One labelled series of a Ray metric: prometheus_client's child interface."""

    def __init__(self, metric, tags: dict[str, str]):
        self.metric = metric
        self.tags = tags

    def inc(self, amount: float = 1.0) -> None:
        if amount > 0:  # Ray refuses 0; prometheus_client uses inc(0) to create a series at zero
            self.metric.inc(amount, self.tags)

    def set(self, value: float) -> None:
        self.metric.set(value, self.tags)

    def observe(self, value: float) -> None:
        self.metric.observe(value, self.tags)


class _Family:
    """A Ray metric with `labels(*values)`, as prometheus_client's metrics have."""

    def __init__(self, metric, labelnames: tuple[str, ...]):
        self.metric = metric
        self.labelnames = labelnames

    def labels(self, *values: str) -> _Child:
        return _Child(self.metric, dict(zip(self.labelnames, values)))


class _CountedHistogram:
    """`metrics.CountedHistogram`'s interface over a Ray histogram (which observes one value at a time)."""

    def __init__(self, histogram, labelnames: tuple[str, ...]):
        self.family = _Family(histogram, labelnames)

    def add_series(self, labels: tuple[str, ...]) -> None:
        """Ray exports a series once it has a sample; nothing to create ahead."""

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        child = self.family.labels(*labels)
        for _ in range(count):
            child.observe(value)


class RaySeries:
    """The four constructors `Metrics` builds its series with (see metrics.PrometheusSeries)."""

    def counter(self, name: str, documentation: str, labels: tuple[str, ...]) -> _Family:
        return self._family(serve_metrics.Counter, name, documentation, labels)

    def gauge(self, name: str, documentation: str, labels: tuple[str, ...]) -> _Family:
        return self._family(serve_metrics.Gauge, name, documentation, labels)

    def histogram(self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> _Family:
        metric = serve_metrics.Histogram(name, documentation, boundaries=list(buckets), tag_keys=labels)
        return _Family(metric, labels)

    def counted_histogram(
        self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> _CountedHistogram:
        return _CountedHistogram(self.histogram(name, documentation, labels, buckets).metric, labels)

    @staticmethod
    def _family(kind: Callable, name: str, documentation: str, labels: tuple[str, ...]) -> _Family:
        return _Family(kind(name, documentation, tag_keys=labels), labels)
