"""The error `rnnserve train` reports as one line (exit status 2)."""

from __future__ import annotations


class TrainError(ValueError):
    """A bad flag combination, or a checkpoint that cannot be read or does not fit this run."""
