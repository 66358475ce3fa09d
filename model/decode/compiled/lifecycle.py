"""A compile's record (what compiled, in how long, what failed) and which row classes a compile takes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kernels.loader import KernelBuild
from ...transformer import Transformer
from .routing import RowClass


@dataclass
class CompileLog:
    """What was compiled and how long it took (seconds per shape class), and what failed."""

    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    kernels: KernelBuild | None = None  # the C++ kernels the steps call (model/kernels/loader.py); None: none apply
    left_out: list[str] = field(default_factory=list)  # optional row classes whose compile failed


def first_line(exc: Exception) -> str:
    """An error's first line: what a log line or `CompileLog.error` keeps of it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def classes_to_compile(
    row_classes: list[RowClass], batch: int | None, model: Transformer, left_out: list[str]
) -> list[RowClass]:
    """All the decoder's row classes, or the one a fixed batch of `batch` rows runs; a hinted class only
    where it pays, and not one whose compile failed (`left_out`). (With one thread, the caller's or the compile
    child's, the same, inductor splits no loop: a hinted class would compile the 2-row graph again.)"""
    classes = [c for c in row_classes if not c.hinted or (many_rows_pay(model) and c.name not in left_out)]
    if batch is None:
        return classes
    return [max((c for c in classes if c.fewest <= max(batch, 1)), key=lambda c: c.fewest)]


def many_rows_pay(model: Transformer) -> bool:
    """Whether a graph traced for many rows is worth its compile: with more than one thread, for the kinds
    of constant state, whose state update runs in the fused loops. Softmax's attention runs in its own
    kernel, and its steps measured no faster on such a graph (benchmarks/results/NOTES.md, "Row classes")."""
    return torch.get_num_threads() > 1 and model.capabilities.constant_state
