"""`rnnserve train --ema-decay D`: an exponential moving average of the weights (Polyak averaging).

After every optimiser step, average <- D * average + (1 - D) * weights. The
average of the last ~1/(1-D) steps sits nearer the bottom of the loss valley
than the last step's weights, which AdamW's noise keeps bouncing around it:
PixelCNN++ and most image likelihood models evaluate such an average. The run
saves the average as its model file; the checkpoint keeps both, so a resume
continues the same average.

The average is float32 whatever the autocast, and covers the parameters only:
buffers (Reformer's rotations, position tables) are not learned, so the model's own are saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from model import Transformer

from .errors import TrainError


@dataclass
class WeightAverage:
    decay: float
    average: dict[str, torch.Tensor]  # parameter name -> float32 tensor on the model's device

    @classmethod
    def start(cls, model: Transformer, decay: float, saved: dict[str, torch.Tensor] | None = None) -> WeightAverage:
        """From a checkpoint's average if it has one, else from the model's current weights."""
        params = dict(model.named_parameters())
        if saved is not None and saved.keys() != params.keys():
            missing, extra = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
            raise TrainError(
                f"the checkpoint's weight average does not match the model's parameters "
                f"(missing: {', '.join(missing) or 'none'}; not in the model: {', '.join(extra) or 'none'}): "
                f"a damaged checkpoint; resume from another one, or start a new run with --init-from"
            )
        source = saved if saved is not None else {name: p.detach() for name, p in params.items()}
        return cls(decay, {name: source[name].to(params[name].device, torch.float32).clone() for name in params})

    @torch.no_grad()
    def update(self, model: Transformer) -> None:
        params = [p.detach() for _, p in model.named_parameters()]
        torch._foreach_lerp_(list(self.average.values()), params, 1.0 - self.decay)

    @torch.no_grad()
    def swap_into(self, model: Transformer) -> None:
        """The model holds the average from now on (parameters only: buffers stay its own)."""
        for name, p in model.named_parameters():
            p.copy_(self.average[name])

    @contextmanager
    def swapped_in(self, model: Transformer) -> Iterator[None]:
        """Inside: the model holds the average; after: its own weights again, unchanged."""
        params = {name: p.detach() for name, p in model.named_parameters()}
        own = {name: p.clone() for name, p in params.items()}
        self.swap_into(model)
        try:
            yield
        finally:
            for name, p in params.items():
                p.copy_(own[name])
