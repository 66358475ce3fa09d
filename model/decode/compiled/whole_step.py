"""What the one-call steps (linear_step.py, hybrid_step.py) share: a decode step of a twin as one operator call
(`WholeStep`), and that call on one state's rows, its arguments gathered once (`StepOnRows`). A kind says which
operator steps, whether another one steps and draws in the same call, and what they read from a state.

one_call.py picks a twin's kind; this module knows none of them (they import it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ...state import ModelState
from ...transformer import Transformer
from .drawing import DrawRows

StepOperator = Callable[..., torch.Tensor]  # a torch.ops.rnnserve operator: tokens (n,), then a step's arguments


@dataclass(frozen=True)
class WholeStep(ABC):
    """One decode step of a twin as one operator call: tokens (n,) for a state's rows -> logits (n, V)."""

    twin: Transformer
    embeddings: tuple[torch.Tensor, torch.Tensor]  # tokens' and positions'
    weights: list[torch.Tensor]
    head_inside: bool  # the categorical head runs in the call; else `twin.head` runs on its output

    def __call__(self, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
        return self.on_rows(state)(tokens)

    def with_draw(self, tokens: torch.Tensor, state: ModelState, rows: DrawRows, drawn: torch.Tensor) -> torch.Tensor:
        """A step, then each row's next token drawn from its logits into `drawn` (n,) as `categorical_draw` draws
        it: for a twin whose head runs inside the step (`head_inside`). Returns the logits (n, V)."""
        return self.on_rows(state).with_draw(tokens, rows, drawn)

    def on_rows(self, state: ModelState) -> StepOnRows:
        """The step on these rows of a state, its call's arguments gathered once: a caller that steps the same rows
        again and again (the compiled decoder's row views) keeps it rather than gathering them every token."""
        step, step_and_draw = self.operators()
        return StepOnRows(self, step, step_and_draw, self.after_tokens(state))

    @abstractmethod
    def operators(self) -> tuple[StepOperator, StepOperator | None]:
        """The operator that steps, and the one that steps and draws in the same call (None: the kind has none, and
        `categorical_draw` draws after the step). Looked up when called: the kernels register them."""

    @abstractmethod
    def after_tokens(self, state: ModelState) -> tuple[object, ...]:
        """The operators' arguments after the tokens, for these rows of a state: its tensors among them."""


@dataclass(frozen=True)
class StepOnRows:
    """A `WholeStep` on one state's rows: tokens (n,) -> logits (n, V). It holds that state's tensors, which the
    call updates in place, so it stays right for as long as the state keeps them."""

    step: WholeStep
    step_operator: StepOperator  # tokens, *after_tokens -> logits (n, V), or the final hidden state (`head_inside`)
    draw_operator: StepOperator | None  # tokens, *after_tokens, *rows, drawn -> logits; None: categorical_draw after
    after_tokens: tuple[object, ...]  # the operators' arguments after the tokens

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.step_operator(tokens, *self.after_tokens)
        return out if self.step.head_inside else self.step.twin.head(out)

    def with_draw(self, tokens: torch.Tensor, rows: DrawRows, drawn: torch.Tensor) -> torch.Tensor:
        """`WholeStep.with_draw` on these rows: in the step's own call where the kind has one that draws, else the
        step's call, then categorical_draw's."""
        assert self.step.head_inside  # the draw needs the head's logits, which the call returns only then
        if self.draw_operator is not None:
            return self.draw_operator(tokens, *self.after_tokens, *rows, drawn)
        logits = self(tokens)
        torch.ops.rnnserve.categorical_draw(logits, *rows, drawn)
        return logits
