"""Which one-call step (a whole decode step as one C++ call, whole_step.py) a decode twin takes: linear_step.py's
for linear models, hybrid_step.py's for hybrid ones, or none (the compiled graphs then run its steps)."""

from __future__ import annotations

from ...transformer import Transformer
from .hybrid_step import hybrid_step_refusal, whole_hybrid_step
from .linear_step import whole_linear_step, whole_step_refusal
from .whole_step import WholeStep


def one_call_refusal(twin: Transformer) -> str | None:
    """Why no one-call step takes this decode twin, or None when one does. Needs the kernels loaded."""
    if twin.config.attention == "hybrid":
        return hybrid_step_refusal(twin)
    return whole_step_refusal(twin)


def one_call_step(twin: Transformer) -> WholeStep | None:
    """The one-call step for this decode twin, or None when none takes it (`one_call_refusal`)."""
    if twin.config.attention == "hybrid":
        return whole_hybrid_step(twin)
    return whole_linear_step(twin)
