"""Each model's own decode-step function, so that a graph compiled with its weights frozen in serves it alone.

Dynamo keeps its compiled graphs per code object and tells models apart by
their parameters' ids, which a model made after another is freed may reuse.
With the weights compiled in as constants (model/compiled_decode.py), a graph
found that way would decode with the freed model's weights. So each model gets
a copy of the step's code, shared by all its decoders (a server's engine, each
`generate` call), and dropped with the model.
"""

from __future__ import annotations

import types
import weakref
from typing import Callable

import torch

from .state import ModelState
from .transformer import Transformer


def _decode_step(model: Transformer, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
    return model.decode_step(tokens, state)


class StepFunctions:
    """One `_decode_step` with a code object of its own per live model."""

    def __init__(self) -> None:
        self._per_model: weakref.WeakKeyDictionary[Transformer, Callable] = weakref.WeakKeyDictionary()

    def __call__(self, model: Transformer) -> Callable:
        fn = self._per_model.get(model)
        if fn is None:
            fn = types.FunctionType(_decode_step.__code__.replace(), _decode_step.__globals__, _decode_step.__name__)
            self._per_model[model] = fn
        return fn


step_function = StepFunctions()  # process-wide: a model's decoders must all find its one function
