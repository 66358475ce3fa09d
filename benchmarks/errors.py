"""The one error type of `rnnserve bench`, importable without torch."""


class BenchError(ValueError):
    """A benchmark option or input is unusable; the message says what to fix."""
